"""Which CUDA IPC handle is left at exit (torch's "Producer process has been terminated before all shared CUDA
tensors released")? One variant per process; grep each one's output for CudaIPCTypes. From the repo root:

    python3 examples/gpu/make_random_model.py --size 0.5b --out /tmp/model_0.5b
    for v in none shared unshare saver_unshare cpu_mm; do
        python3 docs/perf_2026-12-06_s11/ipc_probe.py $v /tmp/model_0.5b > ipc_$v.log 2>&1
        echo "$v: $(grep -c CudaIPCTypes ipc_$v.log)"
    done

Variants: none (engine only, one generate), shared (two shared-layout syncs, the engine shut down without closing
the sync), unshare (the sync closed first: the engine drops its handles), saver_unshare (unshare with the memory
saver on, as the GPU recipe runs), cpu_mm (unshare with SGLang's mm_feature_transport=cpu), cpu_mm_shared. Without
a GPU it runs the same steps on CPU (a dry run of the script)."""
import os
import sys

SHARED = ("shared", "unshare", "saver_unshare", "saver_shared", "cpu_mm", "cpu_mm_shared")
CLOSED = ("unshare", "saver_unshare", "cpu_mm")


def main(variant: str, model: str) -> None:
    import torch

    from mcore_rl.bridge import load_hf_weights
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.parallel import ParallelConfig
    from mcore_rl.config.rollout import RolloutConfig
    from mcore_rl.config.weight_sync import WeightSyncConfig
    from mcore_rl.engine import TrainEngine
    from mcore_rl.models.arch import load_hf_config
    from mcore_rl.parallel import destroy, initialize
    from mcore_rl.rollout.engine import RolloutEngine
    from mcore_rl.weight_sync import WeightSync

    gpu = torch.cuda.is_available()
    hf = load_hf_config(model)
    parallel = ParallelConfig()
    initialize(parallel, hf)
    actor = TrainEngine(hf, ModelConfig(dtype="bf16" if gpu else "fp32", max_seq_len=256), parallel, None)
    load_hf_weights(actor.model_chunks, model, hf)
    extra = {"disable_cuda_graph": True}
    if variant.startswith("cpu_mm"):
        extra["mm_feature_transport"] = "cpu"
    if gpu:
        where = dict(dtype="bf16", attention_backend="triton", sampling_backend="pytorch", mem_fraction_static=0.2,
                     extra_args=extra, enable_memory_saver=variant.startswith("saver"))
    else:  # a dry run of the script on CPU
        where = dict(dtype="fp32", device="cpu", max_total_tokens=1024)
    rollout = RolloutEngine(RolloutConfig(show_progress=False, log_level="error", **where), model)
    samples = rollout.generate([list(range(3, 20))], sampling=rollout.default_sampling(max_new_tokens=4)).samples
    print("generated", len(samples), flush=True)
    sync = None
    if variant in SHARED:
        sync = WeightSync(WeightSyncConfig(layout="shared"), actor.model_chunks, hf, rollout,
                          scratch_dir="/tmp/ipc_scratch", model_path=model, bucket_bytes=1 << 24)
        sync.sync()
        sync.sync()
        print("synced", sync.layout, flush=True)
    if sync is not None and variant in CLOSED:
        sync.close()
        print("closed", flush=True)
    rollout.shutdown()
    destroy()
    print("exit", variant, flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29611"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    main(sys.argv[1], sys.argv[2])
