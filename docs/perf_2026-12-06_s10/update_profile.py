"""Our update against the raw Megatron update at e2e shapes on one GPU: times (interleaved), CPU-op counts and
self CPU time by op name (torch.profiler, CPU only), and Python functions by own time (cProfile)."""
import cProfile, io, pstats, statistics, sys, time, json, collections, os
import torch
from torch.profiler import profile, ProfilerActivity
from mcore_rl.bench.train import MODELS, RawMegatron
from mcore_rl.bench.e2e import _pg_kl_loss
from mcore_rl.config.model import ModelConfig
from mcore_rl.config.optim import OptimConfig
from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.parallel import initialize
from mcore_rl.engine import TrainEngine
from mcore_rl.engine.batching import make_micro_batches

name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-0.5b"
out = sys.argv[2] if len(sys.argv) > 2 else "/tmp"
hf = MODELS[name]
initialize(ParallelConfig(), hf)
mc = ModelConfig(dtype="bf16", attention="sdpa", max_seq_len=4096)
ours = TrainEngine(hf, mc, ParallelConfig(), OptimConfig(lr=1e-6, clip_grad=1.0))
raw = RawMegatron(hf, ModelConfig(dtype="bf16", attention="sdpa", max_seq_len=4096, lm_head="all"), ParallelConfig())
g = torch.Generator().manual_seed(0)
seqs = []
for i in range(64):
    ids = torch.randint(0, hf["vocab_size"], (384,), generator=g)
    m = torch.zeros(384); m[128:] = 1
    seqs.append({"input_ids": ids, "loss_mask": m, "advantages": m * (1 if i % 2 else -1)})
ids = torch.stack([s["input_ids"] for s in seqs]).cuda()
ntok = float(sum(s["loss_mask"].sum() for s in seqs))
mbs_fixed = make_micro_batches(seqs, 4096)
def our(): ours.train_step(make_micro_batches(seqs, 4096), _pg_kl_loss(ntok, False, True))
def our_nomb(): ours.train_step(mbs_fixed, _pg_kl_loss(ntok, False, True))
def rawf(): raw.step(ids, 4096 // 384)
def timed(fn):
    torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize(); return time.perf_counter() - t
for _ in range(2): our(); our_nomb(); rawf()
T = collections.defaultdict(list)
for _ in range(7):
    T["ours"].append(timed(our)); T["ours_nomb"].append(timed(our_nomb)); T["raw"].append(timed(rawf))
res = {k: statistics.median(v) for k, v in T.items()}
res["ratio"] = res["raw"] / res["ours"]
print(json.dumps(res))
# host time alone: launch without waiting (the GPU queue is deep enough?): time to return from the call
def host(fn):
    torch.cuda.synchronize(); t = time.perf_counter(); fn(); h = time.perf_counter() - t; torch.cuda.synchronize()
    return h
H = collections.defaultdict(list)
for _ in range(5):
    H["ours"].append(host(our)); H["raw"].append(host(rawf))
print("host return time", {k: statistics.median(v) for k, v in H.items()})
ops = {}
for nm, fn in (("ours", our), ("raw", rawf)):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn(); torch.cuda.synchronize()
    ops[nm] = {e.key: (e.count, e.self_cpu_time_total, getattr(e, "self_device_time_total", 0)) for e in p.key_averages()}
    p.export_chrome_trace(f"{out}/trace_{nm}.json")
keys = set(ops["ours"]) | set(ops["raw"])
rows = []
for k in keys:
    a = ops["ours"].get(k, (0, 0, 0)); b = ops["raw"].get(k, (0, 0, 0))
    rows.append((a[1] - b[1], k, a[0], b[0], a[1] / 1e3, b[1] / 1e3, a[2] / 1e3, b[2] / 1e3))
rows.sort(reverse=True)
print(f"{'op':60s} {'n_ours':>7s} {'n_raw':>7s} {'cpu_ours_ms':>11s} {'cpu_raw_ms':>10s} {'gpu_ours':>8s} {'gpu_raw':>8s}")
for r in rows[:45] + rows[-15:]:
    d, k, na, nb, ca, cb, ga, gb = r
    print(f"{k[:60]:60s} {na:7d} {nb:7d} {ca:11.2f} {cb:10.2f} {ga:8.2f} {gb:8.2f}")
for nm, fn in (("ours", our), ("raw", rawf)):
    pr = cProfile.Profile(); pr.enable(); fn(); torch.cuda.synchronize(); pr.disable()
    s = io.StringIO(); st = pstats.Stats(pr, stream=s)
    print(f"==== cProfile {nm}: {st.total_calls} calls, {st.total_tt:.3f}s")
    st.sort_stats("tottime").print_stats(30)
    print(s.getvalue()[-8000:])
    s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("cumulative").print_stats(40)
    print(s.getvalue()[-9000:])
