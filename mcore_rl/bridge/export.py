"""Streaming export of a live, sharded Megatron model as HF tensors, in buckets of bounded size.

    exporter = HFWeightExporter(chunks, hf_config, bucket_bytes=512 << 20, destination=0)
    for bucket in exporter:                      # every trainer rank iterates, in lockstep
        if bucket is not None:                   # only receiving ranks get a bucket
            engine.weights.update_bucket(list(bucket))   # [(hf_name, full tensor), ...]

The plan (HF names, shapes, dtypes, owning pipeline stage, bucket boundaries) is built once, on the first
iteration, with one all_gather_object over the world; later iterations exchange only tensor data.

Per bucket, the owning pipeline stage all-gathers each parameter's TP shards, turns them into HF tensors (split
fused q/k/v and gate/up, strip vocab padding), casts them to the export dtype and packs them into one flat buffer
per dtype; the flat buffers then travel to the receiving ranks (broadcast over the pipeline group, or one send).
Yielded tensors are views into those flat buffers (`bucket.flat`), which suits transports that ship flattened
buckets. Memory grows with the bucket, not the model: a rank holds at most one bucket's flat buffers plus the
gathered shards of one parameter.

Destination (who receives full tensors):
* destination="all": every rank of the trainer receives every bucket (TP ranks through the all-gather, other
  stages through a broadcast over the pipeline group; each data-parallel replica works independently).
* destination=r (a global rank, e.g. 0 where rank 0 owns the colocated SGLang engine): only rank r receives
  buckets; the other ranks of r's model-parallel group gather and send, and ranks of other data-parallel replicas
  do nothing. Every rank still iterates and gets None for each bucket.

Layout: "hf" yields HF names and shapes; "engine" yields SGLang's own parameters (bridge.engine_layout: fused
qkv_proj / gate_up_proj, vocabulary padded to a multiple of 64), which the engine copies as they are, with no name
mapping (mcore_rl.weight_sync.receiver.WeightReceiver.update_bucket(..., layout="engine")). Both pack the same HF
tensors in the same order, so an engine tensor is a view over the region its HF tensors occupy
(plus zeroed padding rows): the engine layout costs no extra copy.

Mixture-of-experts layers: an expert's matrices live on one expert-parallel (EP) rank, split over its expert
tensor-parallel group. Per expert parameter, the holders all-gather it over that group; then, per bucket, each run
of consecutive expert items held by one EP rank goes to every rank of the owning stage in one broadcast over the EP
group, straight into the bucket's flat buffer (_broadcast_experts), so afterwards they have them, as for a dense
parameter after its TP all-gather; the rest is the same. EP (and expert-TP) groups cut across the data-parallel
replicas of the dense layers, so with parallel.ep > 1 (or parallel.etp != parallel.tp) every rank of the owning
stage joins these collectives, also for destination=r. Memory stays one bucket plus one expert parameter on the
ranks that keep the bucket; the others of the owning stage receive a run into scratch (at most one bucket).

Bucket bound: buckets are cut at `bucket_bytes` (bytes of the yielded tensors in the export dtype) and at changes of
the owning stage. The unit is one Megatron parameter (fused q/k/v or gate/up stay together); a parameter bigger
than the bound gets a bucket of its own, so such a bucket is bigger than the bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from mcore_rl.bridge.bind import bind, holds_value_head, unwrap
from mcore_rl.bridge.maps import Dims, Kind, expand
from mcore_rl.bridge.transforms import from_shards

DEFAULT_BUCKET_BYTES = 512 * 2**20
LAYOUTS = ("hf", "engine")


@dataclass(frozen=True)
class PlanItem:
    index: int  # entry position in maps.expand(hf)
    hf: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # HF shapes
    dtype: torch.dtype  # export dtype
    owner: int  # pipeline rank holding the parameter
    kind: Kind
    engine: tuple[tuple[str, tuple[int, ...]], ...] | None = None  # engine-layout (name, shape); None: HF layout
    expert: int | None = None  # global expert index of an expert matrix
    ep_owner: int | None = None  # the expert-parallel rank holding that expert

    @property
    def out(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The yielded (name, shape) pairs: the HF tensors, or their engine form."""
        return self.engine if self.engine is not None else tuple(zip(self.hf, self.shapes))

    @property
    def numel(self) -> int:
        """Elements of the item's region of the flat buffer (the HF tensors back to back, then any padding)."""
        return sum(_numel(s) for _, s in self.out)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class BucketPlan:
    items: tuple[PlanItem, ...]
    owner: int  # pipeline rank holding every item of the bucket
    numel: dict  # dtype -> elements of its flat buffer

    @property
    def nbytes(self) -> int:
        return sum(n * _itemsize(d) for d, n in self.numel.items())


@dataclass
class Bucket:
    """Full tensors in the exporter's layout: iterate for (name, tensor) pairs; `flat` holds the per-dtype buffers
    they view."""

    index: int
    named_tensors: list[tuple[str, torch.Tensor]]
    flat: dict[torch.dtype, torch.Tensor]
    layout: str = "hf"

    def __iter__(self):
        return iter(self.named_tensors)

    def __len__(self) -> int:
        return len(self.named_tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat.values())


def _carve(region: torch.Tensor, shapes) -> tuple[list[torch.Tensor], int]:
    """Consecutive views of `region` with these shapes, and how many elements they use."""
    views, off = [], 0
    for shape in shapes:
        views.append(region[off:off + _numel(shape)].view(shape))
        off += _numel(shape)
    return views, off


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_buckets(items: list[PlanItem], bucket_bytes: int) -> list[BucketPlan]:
    """Cut `items` (in order) into buckets of at most bucket_bytes and of one owner; oversized items go alone."""
    buckets: list[list[PlanItem]] = []
    used = 0
    for item in items:
        if not buckets or buckets[-1][0].owner != item.owner or used + item.nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(item)
        used += item.nbytes
    out = []
    for items_ in buckets:
        numel: dict = {}
        for it in items_:
            numel[it.dtype] = numel.get(it.dtype, 0) + it.numel
        out.append(BucketPlan(tuple(items_), items_[0].owner, numel))
    return out


class HFWeightExporter:
    """Iterate over the model's HF tensors in buckets (see the module docstring for who receives what).

    chunks: this rank's model chunks (possibly wrapped by DDP / Float16Module). hf: config.json dict.
    bucket_bytes: bound of one bucket. destination: "all" or a global rank. dtype: export dtype (None keeps each
    parameter's dtype). layout: "hf" or "engine" (see the module docstring; every rank must pass the same).
    critic: the chunks are a critic's (ModelInfo.is_critic): refused, on every rank. A rank holding a value head
    refuses too, whatever `critic` says.
    Must be constructed and iterated by every rank of the trainer, in the same order.
    """

    def __init__(self, chunks: list, hf: dict, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 destination: int | str = "all", dtype: torch.dtype | None = None, layout: str = "hf",
                 critic: bool = False):
        from megatron.core import parallel_state as ps

        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if layout == "engine":
            from mcore_rl.bridge.engine_layout import unsupported_reason

            reason = unsupported_reason(hf)
            if reason is not None:
                raise ValueError(f"the engine layout cannot export this model: {reason}; use layout='hf'")
        world = dist.get_world_size()
        if destination != "all" and not (isinstance(destination, int) and 0 <= destination < world):
            raise ValueError(f"destination must be 'all' or a global rank in [0, {world}), got {destination!r}")
        if ps.get_context_parallel_world_size() != 1:
            raise ValueError("HF export does not support context parallelism")
        if critic or any(holds_value_head(unwrap(c)) for c in chunks):
            raise ValueError("a critic (value head) has no HF causal-LM counterpart to export")
        self.chunks, self.hf, self.bucket_bytes = chunks, hf, bucket_bytes
        self.destination, self.dtype, self.layout = destination, dtype, layout
        self.dims = Dims.from_hf(hf)
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._pp_group = ps.get_pipeline_model_parallel_group()
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self._etp_group = ps.get_expert_tensor_parallel_group()
        self._ep_group = ps.get_expert_model_parallel_group()
        self.etp = ps.get_expert_tensor_parallel_world_size()
        self.ep = ps.get_expert_model_parallel_world_size()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self._plan: list[BucketPlan] | None = None
        self._params: dict[int, torch.Tensor] = {}
        self._receive = True
        self._participate = True

    # ---- plan: built once -------------------------------------------------------------------------------------
    def plan(self) -> list[BucketPlan]:
        """The bucket plan (collective on first call: every rank must call it, or iterate, together)."""
        if self._plan is None:
            self._plan = self._build_plan()
        return self._plan

    def _build_plan(self) -> list[BucketPlan]:
        from megatron.core import parallel_state as ps

        bound = [b for b in bind(self.chunks, self.hf, critic=False) if b.entry.export]
        self._params = {b.index: b.param for b in bound}
        mine = {
            "rank": dist.get_rank(),
            "pp": self.pp_rank,
            "tp": ps.get_tensor_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(),
            "entries": [(b.index, str(b.param.dtype).removeprefix("torch.")) for b in bound],
        }
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)  # the one metadata exchange
        me = everyone[dist.get_rank()]
        owner: dict[int, tuple[int, str]] = {}
        for m in everyone:  # an expert may be held in another data-parallel replica only (expert parallelism)
            for index, dtype in m["entries"]:
                owner.setdefault(index, (m["pp"], dtype))
        entries = expand(self.hf)
        exported = [i for i, e in enumerate(entries) if e.export]
        lost = [entries[i].hf for i in exported if i not in owner]
        assert not lost, f"no pipeline stage holds {lost[:3]}"
        items = []
        for i in exported:
            pp, dtype = owner[i]
            e = entries[i]
            export_dtype = self.dtype or getattr(torch, dtype)
            engine = None
            if self.layout == "engine":
                from mcore_rl.bridge.engine_layout import engine_tensors

                engine = tuple(engine_tensors(e, self.dims))
            ep_owner = None if e.expert is None else e.expert // (self.dims.num_experts // self.ep)
            items.append(PlanItem(i, e.hf, tuple(e.hf_shapes(self.dims)), export_dtype, pp, e.kind, engine,
                                  e.expert, ep_owner))
        if self.destination == "all":
            self._receive = self._participate = True
        else:
            dest = everyone[self.destination]
            self._same_replica = me["dp"] == dest["dp"]
            # Expert groups leave the dense replica unless they are its TP groups (ep 1, etp = tp).
            has_experts = any(it.expert is not None for it in items)
            crosses = self.ep > 1 or self.etp != self.tp
            self._participate = self._same_replica or (has_experts and crosses)
            self._receive = me["rank"] == dest["rank"]
            self._dest = dest
        return plan_buckets(items, self.bucket_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.plan())

    def hf_names(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) of every exported HF tensor, in iteration order (whatever the layout)."""
        return [(n, s, it.dtype) for b in self.plan() for it in b.items for n, s in zip(it.hf, it.shapes)]

    def tensor_specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) of every yielded tensor, in iteration order: hf_names() in the HF layout."""
        return [(n, s, it.dtype) for b in self.plan() for it in b.items for n, s in it.out]

    # ---- iteration --------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Bucket | None]:
        plan = self.plan()
        for k, bp in enumerate(plan):
            yield self._bucket(k, bp)

    def _device(self) -> torch.device:
        if self._params:
            return next(iter(self._params.values())).device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _bucket(self, k: int, bp: BucketPlan) -> Bucket | None:
        if not self._participate:
            return None
        owns = bp.owner == self.pp_rank
        src = dist.get_global_rank(self._pp_group, bp.owner)  # the owner stage's member of this pipeline group
        if self.destination == "all":
            keeps, sends, receives = True, False, not owns
        else:
            from megatron.core import parallel_state as ps

            sends = (owns and self._same_replica and bp.owner != self._dest["pp"]
                     and ps.get_tensor_model_parallel_rank() == self._dest["tp"])
            keeps, receives = self._receive or sends, self._receive and not owns
        flat = views = outs = None
        if keeps:
            flat = {d: torch.empty(n, dtype=d, device=self._device()) for d, n in bp.numel.items()}
            views, outs, pads = self._views(bp, flat)
        if owns:
            # experts first (EP > 1): a few broadcasts for the whole bucket, straight into the flat buffers
            done = self._broadcast_experts(bp, flat if keeps else None)
            for item in bp.items:
                if item.index in done:
                    continue
                tensors = self._gather(item)  # collective over the TP group: every owner-stage rank joins
                if keeps:
                    for view, tensor in zip(views[item.index], tensors):
                        view.copy_(tensor)
                    if item.index in pads:
                        pads[item.index].zero_()
                del tensors
        if self.destination == "all":
            if dist.get_world_size(self._pp_group) > 1:
                for buf in flat.values():
                    dist.broadcast(buf, src=src, group=self._pp_group)
        elif sends:
            for buf in flat.values():
                dist.send(buf, dst=self._dest["rank"])
        elif receives:
            for buf in flat.values():
                dist.recv(buf, src=src)
        if not self._receive:
            return None
        return Bucket(k, [nv for it in bp.items for nv in outs[it.index]], flat, self.layout)

    def _views(self, bp: BucketPlan, flat: dict):
        """Per item: views of its HF tensors (written by the export), the yielded (name, view) pairs over the same
        region, and the padding after the HF tensors (zeroed by the export), if any."""
        offsets = {d: 0 for d in flat}
        views, outs, pads = {}, {}, {}
        for it in bp.items:
            region = flat[it.dtype][offsets[it.dtype]:offsets[it.dtype] + it.numel]
            offsets[it.dtype] += it.numel
            views[it.index], used = _carve(region, it.shapes)
            if used < it.numel:
                pads[it.index] = region[used:]
            names, shapes = zip(*it.out)
            outs[it.index] = list(zip(names, _carve(region, shapes)[0]))
        return views, outs, pads

    def _gather(self, item: PlanItem) -> list[torch.Tensor]:
        """HF tensors of one item from this TP group's shards (collective over the TP group unless replicated).
        An expert's at EP = 1: gathered over the expert-TP group (EP > 1: _broadcast_experts)."""
        if item.expert is not None:
            return self._gather_expert(item)
        local = self._params[item.index].detach().to(item.dtype)
        if self.tp == 1 or item.kind == Kind.REPLICATED:
            return from_shards(item.kind, [local], self.dims)
        shards = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(shards, local.contiguous(), group=self._tp_group)
        return from_shards(item.kind, shards, self.dims)

    def _gather_expert(self, item: PlanItem) -> list[torch.Tensor]:
        """The HF tensors of an expert this EP rank holds (all-gathered over the expert-TP group)."""
        local = self._params[item.index].detach().to(item.dtype)
        if self.etp == 1:
            return from_shards(item.kind, [local], self.dims)
        shards = [torch.empty_like(local) for _ in range(self.etp)]
        dist.all_gather(shards, local.contiguous(), group=self._etp_group)
        return from_shards(item.kind, shards, self.dims)

    def _broadcast_experts(self, bp: BucketPlan, flat: dict | None) -> set[int]:
        """EP > 1: every expert item of the bucket reaches every rank of the owning stage, in one broadcast over the
        EP group per run of consecutive items held by one EP rank (a layer's experts are consecutive, so a bucket
        holding a whole layer takes 2 x EP broadcasts instead of one per expert matrix). Each run is one slice of a
        flat buffer (an expert's region is its HF tensors back to back, no padding): ranks that keep the bucket
        receive straight into it; the others into a scratch buffer of the run's size. Returns the items done.

        Not one collective for the whole bucket: the holders' shares differ in size and sit in several runs, so an
        all_gather would pad every share to the largest and a gather-to-one would move the bucket twice."""
        if self.ep == 1:
            return set()
        offsets: dict = {}
        runs: list[list] = []  # [ep owner, dtype, start, end, items]: the same on every rank (from the plan)
        for it in bp.items:
            start = offsets.get(it.dtype, 0)
            offsets[it.dtype] = start + it.numel
            if it.expert is None:
                continue
            last = runs[-1] if runs else None
            if last is not None and (last[0], last[1], last[3]) == (it.ep_owner, it.dtype, start):
                last[3] = start + it.numel
                last[4].append(it)
            else:
                runs.append([it.ep_owner, it.dtype, start, start + it.numel, [it]])
        for owner, dtype, start, end, items in runs:
            region = flat[dtype][start:end] if flat is not None else torch.empty(end - start, dtype=dtype,
                                                                                   device=self._device())
            if self.ep_rank == owner:
                off = 0
                for it in items:
                    for t in self._gather_expert(it):
                        region[off:off + t.numel()].view(t.shape).copy_(t)
                        off += t.numel()
            dist.broadcast(region, src=dist.get_global_rank(self._ep_group, owner), group=self._ep_group)
        return {it.index for run in runs for it in run[4]}


def measure_export_seconds_per_gb(exporter: HFWeightExporter, repeats: int = 1) -> dict:
    """Time full exports (plan built beforehand, not timed): seconds per GB of HF tensors at this TP / PP.

    Collective: every rank calls it. Returns seconds (mean per export), gbytes, seconds_per_gb, tp, pp,
    bucket_bytes and num_buckets; the benchmark tool prints these.
    """
    from megatron.core import parallel_state as ps

    plan = exporter.plan()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    dist.barrier()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        for bucket in exporter:
            del bucket
    sync()
    dist.barrier()
    seconds = (time.perf_counter() - start) / repeats
    gbytes = exporter.total_bytes / 1e9
    return {"seconds": seconds, "gbytes": gbytes, "seconds_per_gb": seconds / gbytes if gbytes else float("nan"),
            "tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "bucket_bytes": exporter.bucket_bytes, "num_buckets": len(plan)}
