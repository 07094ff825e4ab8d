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

from mcore_rl import console  # noqa: E402
from mcore_rl.config.root import register, to_object  # noqa: E402

if __name__ != "__main__":  # a process the run spawned (SGLang's scheduler) re-imports this file: the run's level
    console.configure_from_env()
register()


def rank0_says(error: Exception) -> None:
    """Exit 2 on an error every rank found alike, with one line from rank 0. The other ranks wait first: exiting
    before rank 0, one would have torchrun stop the rest, rank 0 perhaps before its message (seen on a loaded
    machine). torchrun ends them as soon as rank 0 has exited, so the wait costs nothing: the run's stop-signal
    handlers (which would note torchrun's SIGTERM and go on waiting) give way to the defaults first."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"mcore_rl: {error}", file=sys.stderr, flush=True)
    else:
        import signal
        import time

        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        time.sleep(20)
    sys.exit(2)


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg) -> None:
    from mcore_rl.procs import OutputLockedError

    try:
        config = to_object(cfg)
        console.configure(config.logger.level, config.rollout.log_level)  # before Megatron and SGLang import
        from mcore_rl.trainer.loop import train

        train(config)
    except OutputLockedError as e:  # one line from rank 0, not a traceback per rank
        rank0_says(e)
    except (ValueError, OSError) as e:  # user errors (config, paths, data, a full disk): one line per rank
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        what = "" if isinstance(e, ValueError) else f"{type(e).__name__}: "
        print(f"mcore_rl: error [rank {os.environ.get('RANK', '0')}]: {what}{e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    from mcore_rl.config.cli import check_output_dir, check_overrides

    try:  # before Hydra: its message for a mistyped key suggests appending it with "+"; it makes its log folder
        check_overrides(sys.argv[1:])  # in the output folder, failing with a traceback if it cannot
        check_output_dir(sys.argv[1:])
    except ValueError as e:
        rank0_says(e)
    main()
