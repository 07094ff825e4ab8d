"""One GRPO step end to end, in the trainer loop's order but simplified (one process, one mini-batch, one
epoch, a synthetic reward): rollout (RolloutEngine.generate) -> old log-probs (actor forward) -> reference
log-probs (optional) -> GRPO advantages -> actor update (PPO clip + k3 KL loss) -> colocated weight sync.

The forward-only passes use micro batches of twice the update's token budget, like the trainer's default
actor.forward_max_tokens_per_micro_batch (--forward-max-tokens-per-micro-batch sets it).

`old_logprobs` follows the trainer's actor.old_logprobs (trainer/rl_step.py old_logprob_source): this step is
one optimizer update from the whole batch, so `auto` skips the old log-prob forward and the loss takes the
update's own log-probs, detached, as log pi_old (`e2e.old_logprobs_s` = 0); `recompute` runs it.
`e2e.old_logprobs_mode` says which ran (skip | recompute).

Against the sum of raw parts measured in the same run, interleaved: raw sglang.Engine.generate of the same
prompts and token count, a raw Megatron-Core update of the same token ids (bench.train.RawMegatron), and a plain
copy of the synced weight bytes. The raw parts have no old / reference forward, so the ratio charges those passes
to us: it is what a step costs against the least the libraries need for the same rollout and update. The raw
update computes logits at every position, as Megatron does; ours, like the trainer (model.lm_head=loss_tokens),
only at the response tokens the loss reads (`e2e.lm_head`; --lm-head all does the raw update's work).
`e2e.ratio_vs_raw_parts` = raw parts / our step (1.0 = no overhead; below 1 = slower).

`e2e.ratio_same_work` charges the raw side the same forward-only passes: `e2e.raw_forward_passes` (1 with a
reference, 1 more with recomputed old log-probs) forward passes of the raw Megatron model over the same token ids,
with labels (Megatron's per-token cross entropy, the log-probs' negation), no grad, in micro batches of the
forward-only budget (`e2e.raw_forward_s`, timed with the raw parts but outside `e2e.raw_parts_s`). It is the step's
overhead over the libraries doing all the work it does; `e2e.ratio_vs_raw_parts` also counts the price of the KL
term's reference model.

--rollout-mode one_step_off_policy overlaps as the trainer's trainer.rollout_mode does (docs/async.md): each step
starts generating the next step's batch, on a thread, with the weights it trains from, then runs its forward
passes and update, waits for that generation to finish (`e2e.sync_wait_s`) and syncs. `e2e.rollout_s` is then
the time a step waited for its batch (0 once generation keeps ahead), and the ratio can exceed 1: the raw parts
run one after the other.

With `graphs_both` (`--forward-cuda-graphs both`; the engines are built with model.forward_cuda_graphs=on, static
without a GPU), each repeat runs one step with the forward-only passes eager, one from CUDA graphs and the raw
parts once: `e2e.*` are the eager steps, `e2e.graphs.*` the graphed ones, both against the same raw parts. The
graphed side warms up one step more, since a shape is captured the second time it comes.

`ref_compute_at` (`--ref-compute-at`) is the trainer's ref.compute_at (trainer/rl_step.py ref_in_update): auto
computes the reference log-probs in the update, on its micro batches, where the reference runs from graphs and the
old log-probs are not recomputed (with graphs_both: on the graphed side only), `forward` before the update as a
separate phase. `e2e.ref_in_update` (`e2e.graphs.ref_in_update`) says which ran; in the update, the reference's
time is part of `update_s`.

With `sync_debug` (`--sync-debug`, GPU only), one more step of ours (and with graphs_both one graphed step) and
one raw update run under `torch.cuda.set_sync_debug_mode("warn")`: `e2e.sync_debug.{ours,graphs,raw_update}`
count the host syncs each made (the bench's own timing syncs left out) and `..._where` lists where (file:line of
the Python call, most frequent first). A host-bound step loses its overlap with the GPU at every sync.

With a profile directory (`--profile DIR`), one more step of ours and one of the raw parts run under
torch.profiler after the timed ones: `e2e.profile.{phase}.{wall,device_busy}_s` say, per phase, how long it took and
how long the GPU ran kernels in it (a phase whose busy time is well below its wall time waits on the host), and
DIR/e2e_profile.txt has the top operators of both sides by GPU and by host time.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.profiler import record_function

from mcore_rl.bench.common import median, raw_sglang, timed


def phase(name: str, fn):
    """timed(fn), marked `name` for the profiler."""
    with record_function(name):
        return timed(fn)


def _pg_kl_loss(num_tokens: float, with_ref: bool, on_policy: bool, kl_coef: float = 0.001):
    from mcore_rl import algorithms as alg

    def loss_fn(out, mb):
        mask = mb["loss_mask"]
        old = out["logprobs"].detach() if on_policy else mb["old_logprobs"]
        loss, _ = alg.compute_policy_loss("ppo", logprobs=out["logprobs"], old_logprobs=old,
                                          advantages=mb["advantages"], response_mask=mask,
                                          global_num_tokens=num_tokens)
        if with_ref:
            kl, _ = alg.kl_loss(out["logprobs"], mb["ref_logprobs"], mask, estimator="k3",
                                global_num_tokens=num_tokens)
            loss = loss + kl_coef * kl
        return loss, {}

    return loss_fn


class GRPOStep:
    """Our step, its parts timed separately (seconds in `last`)."""

    def __init__(self, engine, actor, ref, hf: dict, bucket_bytes: int, max_tokens_per_micro_batch: int,
                 old_logprobs: str = "auto", sync_layout: str = "auto", forward_max_tokens: int = 0,
                 rollout_mode: str = "sync", ref_compute_at: str = "auto"):
        from mcore_rl.config.rl import ActorConfig
        from mcore_rl.config.weight_sync import WeightSyncConfig
        from mcore_rl.weight_sync import WeightSync

        if old_logprobs not in ("auto", "recompute"):
            raise ValueError(f"old_logprobs must be auto or recompute, got {old_logprobs!r}")
        if rollout_mode not in ("sync", "one_step_off_policy"):
            raise ValueError(f"rollout_mode must be sync or one_step_off_policy, got {rollout_mode!r}")
        self.overlap = rollout_mode == "one_step_off_policy"
        self._next = None  # overlap: the next step's generation, running
        self.engine, self.actor, self.ref = engine, actor, ref
        self.recompute = old_logprobs == "recompute"  # auto: one update from the whole batch, so skip
        self.ref_compute_at = ref_compute_at
        self.ref_in_update = False  # the last step's
        # the trainer's weight sync, in the layout it would choose (sync_layout=auto) or the one asked for
        self.sync = WeightSync(WeightSyncConfig(layout=sync_layout), actor.model_chunks, hf, engine,
                               bucket_bytes=bucket_bytes)
        self.max_tokens = max_tokens_per_micro_batch
        # forward-only passes: the trainer's actor.forward_max_tokens_per_micro_batch, resolved by its own rule
        self.forward_max_tokens = ActorConfig(max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                                              forward_max_tokens_per_micro_batch=forward_max_tokens
                                              ).forward_tokens_per_micro_batch
        self.last: dict[str, float] = {}

    def __call__(self, prompts, n, sampling) -> int:
        from mcore_rl import algorithms as alg
        from mcore_rl.engine.batching import make_micro_batches
        from mcore_rl.trainer.rl_step import attach_ref_logprobs, gather_tokens, ref_in_update

        from mcore_rl.rollout.backend import run_in_thread

        t = {}

        def generate():
            return self.engine.generate(prompts, n=n, sampling=sampling)

        if self.overlap:
            if self._next is None:  # the first step has nothing generated ahead
                self._next = run_in_thread(generate)
            t["rollout"], batch = phase("e2e.rollout", self._next.result)
            self._next = run_in_thread(generate)  # the next step's batch, with the weights this step trains from
        else:
            t["rollout"], batch = phase("e2e.rollout", generate)
        samples = batch.samples
        seqs = []
        for s in samples:
            p, r = len(s.prompt_ids), len(s.response_ids)
            mask = torch.zeros(p + r)
            mask[p:] = 1.0
            seqs.append({"input_ids": torch.tensor(s.prompt_ids + s.response_ids), "loss_mask": mask})

        def logprobs(engine):  # the trainer's path: rl_step.gather_tokens (per-sequence host tensors)
            mbs = make_micro_batches(seqs, self.forward_max_tokens)
            return gather_tokens(engine.compute_logprobs(mbs), mbs, "logprobs")

        t["old_logprobs"], old = (phase("e2e.old_logprobs", lambda: logprobs(self.actor)) if self.recompute
                                  else (0.0, None))
        # the trainer's rule (ref.compute_at); eager_forward() hides the graphs, so the eager side computes it first
        self.ref_in_update = ref_in_update(self.ref_compute_at, self.ref, kl_in_reward=False,
                                           old_source="recompute" if self.recompute else "current")
        t["ref_logprobs"], ref = (phase("e2e.ref_logprobs", lambda: logprobs(self.ref))
                                  if self.ref is not None and not self.ref_in_update else (0.0, None))

        def update():
            # synthetic reward: share of even token ids in the response (varies within a group)
            lengths = torch.tensor([len(s.response_ids) for s in samples])
            scores = torch.stack([(seq["input_ids"][-n:] % 2 == 0).float().mean() if n else torch.tensor(0.0)
                                  for seq, n in zip(seqs, lengths.tolist())])
            group_ids = torch.tensor([s.group_id for s in samples])
            rmask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).float()
            adv, _ = alg.compute_advantages("grpo", scores=scores, group_ids=group_ids, response_mask=rmask)
            for i, seq in enumerate(seqs):
                if old is not None:
                    seq["old_logprobs"] = old[i]
                seq["advantages"] = seq["loss_mask"] * adv[i, 0]
                if ref is not None:
                    seq["ref_logprobs"] = ref[i]
            train_mbs = make_micro_batches(seqs, self.max_tokens)
            num_tokens = float(sum(seq["loss_mask"].sum() for seq in seqs))
            if self.ref_in_update:
                attach_ref_logprobs(self.ref, train_mbs, 1.0)
            self.actor.train_step(train_mbs, _pg_kl_loss(num_tokens, self.ref is not None, not self.recompute))

        t["update"], _ = phase("e2e.update", update)
        if self.overlap:  # a sync waits for the generation in flight (trainer.partial_rollouts=finish)
            t["sync_wait"], _ = phase("e2e.sync_wait", self._next.exception)
        t["sync"], _ = phase("e2e.sync", self.sync.sync)
        self.last = t
        self.last_ids = torch.stack([s["input_ids"] for s in seqs])
        self.nbytes = self.sync.last_bytes
        return sum(len(s.response_ids) for s in samples)


def count_syncs(fn) -> tuple[int, list[str]]:
    """The host syncs fn makes on the GPU (torch.cuda.set_sync_debug_mode): how many, and where ("file:line xN",
    the Python call that synced, most frequent first), without the bench's own timing syncs (bench/common.py)."""
    import collections
    import warnings

    where: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message) and not w.filename.endswith(os.path.join("bench", "common.py")):
            where[f"{w.filename}:{w.lineno}"] += 1
    return sum(where.values()), [f"{k} x{v}" for k, v in where.most_common(20)]


@contextlib.contextmanager
def eager_forward(*engines):
    """The engines' forward-only passes without their CUDA graphs (graphs kept for afterwards)."""
    saved = [(e, e.graphed) for e in engines if e is not None]
    for e, _ in saved:
        e.graphed = None
    try:
        yield
    finally:
        for e, graphed in saved:
            e.graphed = graphed


def run(engine, actor, ref, hf: dict, prompts: list[list[int]], n: int, max_new_tokens: int, bucket_bytes: int,
        max_tokens_per_micro_batch: int = 4096, repeats: int = 2, warmup: int = 1,
        old_logprobs: str = "auto", sync_layout: str = "auto", forward_max_tokens: int = 0,
        rollout_mode: str = "sync", profile_dir: str | None = None, attention: str = "sdpa",
        graphs_both: bool = False, sync_debug: bool = False, ref_compute_at: str = "auto") -> dict:
    from mcore_rl.bench.common import model_dtype
    from mcore_rl.bench.train import RawMegatron
    from mcore_rl.bench.weight_sync import PlainCopy, baseline_exporter
    from mcore_rl.config.model import ModelConfig
    from mcore_rl.config.parallel import ParallelConfig

    sampling = engine.default_sampling(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    step = GRPOStep(engine, actor, ref, hf, bucket_bytes, max_tokens_per_micro_batch, old_logprobs, sync_layout,
                    forward_max_tokens, rollout_mode, ref_compute_at)
    raw = raw_sglang(engine)
    raw_ids = [list(p) for p in prompts for _ in range(n)]
    raw_params = sampling.to_sglang()
    raw_train = RawMegatron(hf, ModelConfig(dtype=model_dtype(), attention=attention, max_seq_len=4096,
                                            lm_head="all"), ParallelConfig())
    copy = PlainCopy(baseline_exporter(step.sync, actor.model_chunks, hf, bucket_bytes))
    # forward-only passes our step runs besides the update (the reference's log-probs, the old policy's when
    # recomputed): the raw side's same work is that many forward passes of the raw model over the same tokens
    passes = int(ref is not None) + int(step.recompute)

    def raw_parts() -> dict[str, float]:
        gen, _ = phase("raw.rollout", lambda: raw.generate(input_ids=raw_ids, sampling_params=raw_params,
                                                           return_logprob=True))
        ids = step.last_ids.to(raw_train.device)  # same token ids as our last update
        # micro batches of at most the token budget our update packs into one micro batch
        upd, _ = phase("raw.update", lambda: raw_train.step(ids, max(1, max_tokens_per_micro_batch // ids.size(1))))
        cp, _ = phase("raw.sync", copy)
        parts = {"rollout": gen, "update": upd, "sync": cp}
        if passes:  # not in raw_parts_s (the figure as it has always been), only in the same-work figure
            rows = max(1, step.forward_max_tokens // ids.size(1))
            parts["forward"], _ = phase("raw.forward", lambda: [raw_train.forward_only(ids, rows)
                                                                for _ in range(passes)])
        return parts

    if graphs_both and actor.graphed is None:
        raise ValueError("graphs_both needs engines whose forward passes run from CUDA graphs (model."
                         "forward_cuda_graphs on or static); this one's are eager: "
                         f"{actor.graphs_off_reason or 'model.forward_cuda_graphs is off'}")

    def ours():  # with graphs_both, the eager side
        with eager_forward(actor, ref) if graphs_both else contextlib.nullcontext():
            return step(prompts, n, sampling)

    def graphed():
        return step(prompts, n, sampling)

    for _ in range(warmup):
        ours(), raw_parts()
    for _ in range(warmup + 1 if graphs_both else 0):
        graphed()
    mine, theirs, totals, raw_totals, same_totals, g_mine, g_totals = [], [], [], [], [], [], []
    tokens = 0
    in_update = {}
    for _ in range(repeats):  # interleaved
        total, tokens = timed(ours)
        mine.append(step.last)
        totals.append(total)
        in_update["e2e."] = step.ref_in_update
        if graphs_both:
            total, _ = timed(graphed)
            g_mine.append(step.last)
            g_totals.append(total)
            in_update["e2e.graphs."] = step.ref_in_update
        r = raw_parts()
        theirs.append(r)
        raw_totals.append(r["rollout"] + r["update"] + r["sync"])
        same_totals.append(sum(r.values()))
    out = {"e2e.num_samples": len(raw_ids), "e2e.new_tokens": tokens, "e2e.train_tokens": int(step.last_ids.numel()),
           "e2e.raw_parts_s": median(raw_totals), "e2e.raw_forward_passes": passes,
           "e2e.raw_parts_same_work_s": median(same_totals),
           "e2e.old_logprobs_mode": "recompute" if step.recompute else "skip", "e2e.sync_layout": step.sync.layout,
           "e2e.lm_head": actor.model_info.lm_head,
           "e2e.forward_max_tokens_per_micro_batch": step.forward_max_tokens, "e2e.rollout_mode": rollout_mode,
           "e2e.attention": attention,
           "e2e.forward_cuda_graphs": "both" if graphs_both else "on" if actor.graphed is not None else "off"}
    for prefix, steps, step_totals in (("e2e.", mine, totals), ("e2e.graphs.", g_mine, g_totals)):
        if not steps:
            continue
        out[f"{prefix}step_s"] = median(step_totals)
        out[f"{prefix}ref_in_update"] = in_update[prefix]
        out[f"{prefix}ratio_vs_raw_parts"] = out["e2e.raw_parts_s"] / out[f"{prefix}step_s"]
        out[f"{prefix}ratio_same_work"] = out["e2e.raw_parts_same_work_s"] / out[f"{prefix}step_s"]
        for part in steps[0]:
            out[f"{prefix}{part}_s"] = median([o[part] for o in steps])
        out[f"{prefix}other_s"] = out[f"{prefix}step_s"] - sum(out[f"{prefix}{p}_s"] for p in steps[0])
    if graphs_both:
        out["e2e.graphs.captures"] = sum(e.graphed.num_captures for e in (actor, ref) if e is not None)
    for part in theirs[0]:
        out[f"e2e.raw_{part}_s"] = median([r[part] for r in theirs])
    if sync_debug and torch.cuda.is_available():
        ids = step.last_ids.to(raw_train.device)
        rows = max(1, max_tokens_per_micro_batch // ids.size(1))  # raw_parts' micro batches
        sides = [("ours", ours)] + ([("graphs", graphed)] if graphs_both else [])
        for name, fn in sides + [("raw_update", lambda: raw_train.step(ids, rows))]:
            out[f"e2e.sync_debug.{name}"], out[f"e2e.sync_debug.{name}_where"] = count_syncs(fn)
    if profile_dir:
        out.update(_profile(ours, raw_parts, profile_dir))
    del raw_train
    return out


def _profile(our_step, raw_parts, out_dir: str) -> dict:
    """One step of each side under torch.profiler: per phase (the `phase` marks) its wall time and the GPU's busy
    time within it; the operator tables go to out_dir/e2e_profile.txt."""
    from torch.profiler import ProfilerActivity, profile

    from mcore_rl.bench.profile_train import _table

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    result, tables = {}, []
    for side, fn in (("ours", our_step), ("raw", raw_parts)):
        with profile(activities=activities) as prof:
            fn()
        events = prof.events()
        marks = [e for e in events if e.name.startswith(("e2e.", "raw.")) and e.device_type.name == "CPU"]
        kernels = [e for e in events if e.device_type.name != "CPU" and not e.name.startswith(("e2e.", "raw."))
                   and not getattr(e, "is_user_annotation", False)]
        lines = []
        for m in marks:
            lo, hi = m.time_range.start, m.time_range.end
            busy = sum(k.time_range.elapsed_us() for k in kernels if lo <= k.time_range.start < hi) / 1e6
            wall = (hi - lo) / 1e6
            key = m.name.replace("e2e.", "e2e.profile.").replace("raw.", "e2e.profile.raw_")
            result[f"{key}.wall_s"], result[f"{key}.device_busy_s"] = wall, busy
            lines.append(f"{m.name}: wall {wall:.4f} s, GPU busy {busy:.4f} s")
        tables.append(f"==== {side}\n" + "\n".join(lines) + "\n" + _table(prof, 40)
                      + "\n-- by host time\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                                                          max_name_column_width=70))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "e2e_profile.txt"), "w") as f:
        f.write("\n\n".join(tables))
    return result
