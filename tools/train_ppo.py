"""Train a policy with PPO / GRPO and relatives: Megatron-Core actor (and critic), SGLang rollouts.

    torchrun --nproc_per_node 2 tools/train_ppo.py                         # CPU default: GRPO, SmolLM2
    torchrun --nproc_per_node 2 tools/train_ppo.py experiment=ppo_critic trainer.total_steps=5
    torchrun --nproc_per_node 8 tools/train_ppo.py experiment=qwen2_5_7b_8gpu model.path=/ckpt/Qwen2.5-7B
    python tools/train_ppo.py --cfg job                                    # print the resolved config

Multi-node: one torchrun per node with --nnodes/--node_rank/--rdzv_endpoint (docs/multinode.md).
"""

import os
import sys

import hydra

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcore_rl.config.root import register, to_object  # noqa: E402

register()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg) -> None:
    from mcore_rl.procs import OutputLockedError
    from mcore_rl.trainer.loop import train

    try:
        train(to_object(cfg))
    except OutputLockedError as e:  # one line from rank 0, not a traceback per rank
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"mcore_rl: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
