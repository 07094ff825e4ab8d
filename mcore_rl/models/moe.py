"""Mixture-of-experts settings: HF config (Qwen3-MoE, Mixtral) -> the MoE fields of Megatron's TransformerConfig.

Both architectures put a top-k MoE MLP in every decoder layer: router `mlp.gate` (a [E, h] matrix, no bias),
softmax over the E experts, top-k, SwiGLU experts. They differ only in how the k weights are normalised:

* Mixtral and Qwen3-MoE with norm_topk_prob=true renormalise the top-k softmax probabilities to sum to one, which
  is the softmax of the top-k logits: Megatron's router with moe_router_pre_softmax=False (top-k on the logits,
  then softmax over the k).
* Qwen3-MoE with norm_topk_prob=false keeps the top-k of the softmax over all experts: moe_router_pre_softmax=True.

Which code runs where (megatron-core 0.16.1):

* Experts: SequentialMLP (one MLP per local expert, plain matmuls; CPU and GPU) unless grouped GEMM is chosen
  (ModelConfig.moe_grouped_gemm), which needs Transformer Engine's TEGroupedMLP (GPU). Megatron's legacy
  GroupedMLP (the `grouped_gemm` package: CUDA only, bf16 only, all local experts fused into one weight) is not
  offered: its fused layout has no bridge mapping.
* Token dispatcher (ModelConfig.moe_token_dispatcher): alltoall by default, on gloo (CPU) and NCCL: each rank
  sends its routed tokens to the experts' ranks (torch.distributed.all_to_all_single, which gloo implements).
  allgather gathers every token on every expert rank; Megatron refuses it with variable_seq_lengths, which the
  pipeline needs, so it is only allowed at parallel.pp=1.
* Routing, the auxiliary losses and the permutation run in plain torch (the fused TE router and permutation
  kernels, moe_router_fusion / moe_permute_fusion, stay off).
* Without Transformer Engine, megatron-core 0.16.1's router fails with NameError 'te_general_gemm' (moe_utils
  imports it only when TE imports, yet reads it unconditionally): `define_missing_te_names` sets the names TE would
  have provided to None, which sends the router to its torch.mm path. On CPU and on GPUs without TE alike.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.models.arch import ArchSpec


# Names megatron.core.transformer.moe.moe_utils imports from Transformer Engine, and tests against None.
_TE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute", "fused_permute_with_probs",
             "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
             "fused_unpermute", "te_general_gemm")


def define_missing_te_names() -> list[str]:
    """Without Transformer Engine, define moe_utils' TE names as None (see the module docstring); returns those set.
    Idempotent; does nothing when TE imported."""
    from megatron.core.transformer.moe import moe_utils

    missing = [n for n in _TE_NAMES if not hasattr(moe_utils, n)]
    for name in missing:
        setattr(moe_utils, name, None)
    return missing


def num_experts(hf: dict) -> int:
    """Routed experts per MoE layer (Qwen3-MoE's config.json says num_experts, Mixtral's num_local_experts)."""
    n = hf.get("num_experts") or hf.get("num_local_experts")
    if not n:
        raise ValueError("config.json of a mixture-of-experts model has neither num_experts nor num_local_experts")
    return int(n)


def expert_ffn(hf: dict, arch: ArchSpec) -> int:
    """Intermediate size of one expert: Qwen3-MoE's moe_intermediate_size, Mixtral's intermediate_size."""
    return int(hf["moe_intermediate_size"]) if arch.name == "qwen3_moe" else int(hf["intermediate_size"])


def refuse_unsupported(hf: dict, arch: ArchSpec) -> None:
    """MoE config switches the Megatron model cannot express, as ValueErrors that say what is supported."""
    if arch.name == "qwen3_moe":
        sparse_step = hf.get("decoder_sparse_step", 1)
        dense = hf.get("mlp_only_layers") or []
        if sparse_step != 1 or dense:
            raise ValueError(
                f"Qwen3MoeForCausalLM with dense MLP layers (decoder_sparse_step={sparse_step}, "
                f"mlp_only_layers={dense}) is not supported: only models whose every layer is a mixture of experts "
                "(decoder_sparse_step=1, mlp_only_layers=[]), as all released Qwen3-MoE checkpoints are"
            )
    if hf.get("shared_expert_intermediate_size") or hf.get("n_shared_experts"):
        raise ValueError(f"{arch.hf_class} with shared experts is not supported: routed experts only")
    if arch.name == "mixtral" and hf.get("router_jitter_noise"):
        raise ValueError(
            f"MixtralForCausalLM with router_jitter_noise={hf['router_jitter_noise']} is not supported (Megatron's "
            "input jitter differs from HF's); set router_jitter_noise to 0 in config.json"
        )


def validate_experts(hf: dict, parallel: ParallelConfig) -> None:
    """Expert parallelism against the number of experts (the world is checked by mcore_rl.parallel.validate)."""
    experts = num_experts(hf)
    top_k = hf.get("num_experts_per_tok", 2)
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) is larger than the number of experts ({experts})")
    if experts % parallel.ep:
        raise ValueError(
            f"the number of experts ({experts}) is not divisible by parallel.ep ({parallel.ep}); every "
            f"expert-parallel rank holds the same number of experts: use a parallel.ep that divides {experts}"
        )
    etp = parallel.etp or parallel.tp
    if parallel.ep == 1 and etp != parallel.tp:
        # Megatron-Core 0.16.1 marks expert weights as expert-parallel (allreduce=False: reduced and broadcast over
        # the expert-data-parallel group) only when expert_model_parallel_size > 1. At ep=1 they are reduced and
        # broadcast over the dense data-parallel group, whose ranks hold other expert-TP shards: DDP's start-up
        # broadcast overwrites them and their gradients are summed with the wrong shards (seen at etp=2, tp=1:
        # grad norm 3.96 instead of 3.53).
        raise ValueError(
            f"parallel.etp ({etp}) differs from parallel.tp ({parallel.tp}) at parallel.ep=1, which Megatron-Core "
            "does not train correctly (expert shards are then reduced with the dense data-parallel ranks); set "
            "parallel.etp=null (the same as parallel.tp) or split the experts with parallel.ep > 1 as well"
        )


def grouped_gemm(model_cfg: ModelConfig, te: bool) -> bool:
    """Whether the experts run as grouped GEMMs (TEGroupedMLP) rather than one after the other (SequentialMLP)."""
    if model_cfg.moe_grouped_gemm == "on" and not te:
        raise ValueError(
            "model.moe_grouped_gemm=on needs Transformer Engine's TEGroupedMLP (model.attention=te, or auto with "
            "transformer_engine installed on a GPU); use moe_grouped_gemm=auto or off for sequential experts"
        )
    return te and model_cfg.moe_grouped_gemm != "off"


def moe_fields(hf: dict, arch: ArchSpec, model_cfg: ModelConfig, parallel: ParallelConfig) -> dict:
    """TransformerConfig keyword arguments of the MoE layers ({} for a dense architecture)."""
    if not arch.moe:
        if parallel.ep > 1:
            raise ValueError(f"parallel.ep ({parallel.ep}) > 1 needs a mixture-of-experts model; "
                             f"{arch.hf_class} is dense: set parallel.ep=1")
        if model_cfg.moe_routing_replay:
            raise ValueError(f"model.moe_routing_replay=true replays mixture-of-experts routes, but {arch.hf_class} "
                             "is dense (no routers): set model.moe_routing_replay=false")
        return {}
    refuse_unsupported(hf, arch)
    validate_experts(hf, parallel)
    if parallel.tp > 1 and not parallel.sequence_parallel:
        raise ValueError(
            f"a mixture-of-experts model at parallel.tp ({parallel.tp}) > 1 needs parallel.sequence_parallel=true: "
            "Megatron refuses to train MoE layers with tensor parallelism but without sequence parallelism; set it, "
            "or split the experts with parallel.ep and parallel.etp and keep parallel.tp=1"
        )
    if model_cfg.moe_token_dispatcher == "allgather" and parallel.pp > 1:
        raise ValueError(
            f"model.moe_token_dispatcher=allgather does not work with parallel.pp ({parallel.pp}) > 1: Megatron "
            "refuses it with the variable sequence lengths the pipeline exchanges; use alltoall"
        )
    # Qwen3-MoE: norm_topk_prob (false in its config class, true in every released checkpoint); Mixtral: always.
    renormalise = bool(hf.get("norm_topk_prob", False)) if arch.name == "qwen3_moe" else True
    return dict(
        num_moe_experts=num_experts(hf),
        moe_ffn_hidden_size=expert_ffn(hf, arch),
        moe_router_topk=int(hf.get("num_experts_per_tok", 2)),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not renormalise,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
        moe_z_loss_coeff=model_cfg.moe_z_loss_coeff or None,
        moe_token_dispatcher_type=model_cfg.moe_token_dispatcher,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp or parallel.tp,
        # Routers get a RouterReplay only when asked: without one, routing is Megatron's own code path unchanged.
        moe_enable_routing_replay=model_cfg.moe_routing_replay,
    )


# ---- routing replay and router statistics ------------------------------------------------------------------------

class RouterHooks:
    """Hooks on every MoE router of one model's chunks, driven by the engine around each micro batch's forward call.

    Routing replay (ModelConfig.moe_routing_replay): the routes a micro batch carries (field "routed_experts",
    [b, s, num_layers, topk] expert ids, e.g. the ones the rollout engine used) replace the router's own top-k
    through Megatron's RouterReplay (TransformerConfig.moe_enable_routing_replay): REPLAY_FORWARD gathers the
    router's scores at the given experts, so the k weights still come from this model's logits and get gradients.
    Activation recompute (model.recompute=full) re-runs the router in backward, outside any micro batch's forward
    call; RouterReplay then pops the routes in the order the forwards pushed them (REPLAY_BACKWARD), which is the
    order Megatron's schedules run each chunk's backwards in. Megatron's own global instance list is not used: it
    holds the routers of every model of the process (actor and reference), these hooks only this model's.

    Router statistics (training passes only, `measure`): per layer, Megatron's Switch load-balancing loss of each
    micro batch over its real tokens, the token-summed z-loss, and tokens dispatched per expert, accumulated on
    the device; `collect` reduces them once (over data- and pipeline-parallel ranks) and reads them to the host.
    """

    def __init__(self, chunks, config):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        self.num_layers = config.num_layers
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.sequence_parallel = bool(config.sequence_parallel)
        self.replay = bool(config.moe_enable_routing_replay)
        # the configs the routers read their loss coefficients from (one object, shared by every layer, in practice)
        self._configs = list({id(r.config): r.config for r in self.routers}.values())
        self.aux_coeff = float(config.moe_aux_loss_coeff or 0.0)
        self.z_coeff = float(config.moe_z_loss_coeff or 0.0)
        self._inside = False  # in a micro batch's forward call (not in a backward recompute)
        self._measure = False
        self._routes: torch.Tensor | None = None  # [N, L, K] int64, router token order (s-major, then b)
        self._valid: torch.Tensor | None = None  # [N] float, 1 on real tokens
        self._stats: torch.Tensor | None = None  # [L, 4 + E] float64: see _after_router
        for router in self.routers:
            router.register_forward_pre_hook(self._before_router)
            router.register_forward_hook(self._after_router)

    # -- around the schedule ---------------------------------------------------------------------------------
    def begin_pass(self) -> None:
        """Forget any routes left by a pass that failed part-way."""
        for router in self.routers:
            if router.router_replay is not None:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    end_pass = begin_pass

    def _tp_share(self) -> int:
        if not self.sequence_parallel:
            return 1
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_world_size()

    @property
    def has_losses(self) -> bool:
        """Whether training passes add a load-balancing or z-loss to the gradients."""
        return self.aux_coeff > 0 or self.z_coeff > 0

    @contextlib.contextmanager
    def token_mean(self, total_tokens: float):
        """Around a training pass over `total_tokens` real tokens (all its micro batches, all data-parallel ranks):
        the aux and z losses enter the gradients as coeff x their token-weighted mean over the pass.

        Megatron's routers, in per-token-loss mode, multiply each micro batch's aux and z loss by its real token
        count and leave the division by the pass's total to finalize_model_grads. The engine's finalize step does
        not divide (its losses arrive normalised), so the coefficients are divided here instead. The routers copy
        calculate_per_token_loss from the config when they are built, before the engine turns it on
        (forward_backward.configure_model_config), so it is turned on for them here too. Both for this pass only.

        With sequence parallelism each tensor-parallel rank routes its slice of a micro batch, its share of the
        losses is multiplied by its own token count, and the router's gradient is summed over the ranks: the
        coefficients are multiplied by the TP size to make up for the slices. That is exact when the slices hold
        equal numbers of real tokens; a micro batch padded to a multiple of TP puts its padding (fewer than TP
        tokens) in the last slice, which then weighs its part of the micro batch's losses slightly less."""
        def set_losses(scale: float, per_token: list[bool]) -> None:
            for r, flag in zip(self.routers, per_token):
                r.calculate_per_token_loss = flag
            for c in self._configs:
                c.moe_aux_loss_coeff = self.aux_coeff * scale
                c.moe_z_loss_coeff = self.z_coeff * scale if self.z_coeff > 0 else None

        built = [r.calculate_per_token_loss for r in self.routers]
        set_losses(self._tp_share() / total_tokens, [True] * len(self.routers))
        try:
            yield
        finally:
            set_losses(1.0, built)

    @contextlib.contextmanager
    def micro_batch(self, routes: torch.Tensor | None, valid_mask: torch.Tensor, measure: bool):
        """Around one micro batch's model call. routes: [b, s, L, K] or None (the router's own top-k: sequences
        without rollout routes, e.g. a dpo task's); valid_mask: [b, s] bool, False on padding."""
        valid = self._router_order(valid_mask)
        self._valid = valid.float()
        self._routes = None
        if routes is not None and self.replay:
            routes = self._router_order(routes).long()
            # Padding has no route from anywhere; any k distinct experts do (its outputs are never read).
            filler = torch.arange(self.topk, device=routes.device)
            self._routes = torch.where(valid[:, None, None], routes, filler)
        self._inside, self._measure = True, measure
        try:
            yield
        finally:
            self._inside, self._measure = False, False
            self._routes = self._valid = None

    def _router_order(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, ...] -> [s * b, ...] in the order the router flattens its [s, b, h] input; with sequence
        parallelism, this tensor-parallel rank's slice of s."""
        x = x.transpose(0, 1)
        if self.sequence_parallel:
            from megatron.core import parallel_state

            tp = parallel_state.get_tensor_model_parallel_world_size()
            rank = parallel_state.get_tensor_model_parallel_rank()
            chunk = x.size(0) // tp
            x = x[rank * chunk:(rank + 1) * chunk]
        return x.reshape(-1, *x.shape[2:])

    # -- the hooks -------------------------------------------------------------------------------------------
    def _before_router(self, router, args) -> None:
        replay = router.router_replay
        if replay is None:
            return
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if not self._inside:  # backward recompute: the routes of the forwards, first in first out
            if replay.replay_backward_list:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                replay.clear_router_replay_action()
            return
        if self._routes is None:
            replay.clear_router_replay_action()
            return
        tokens = args[0].shape[0] * args[0].shape[1]
        if self._routes.size(0) != tokens:
            raise RuntimeError(f"routing replay: the micro batch carries routes for {self._routes.size(0)} tokens, "
                               f"the router of layer {router.layer_number} sees {tokens}")
        replay.set_target_indices(self._routes[:, router.layer_number - 1])
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    @torch.no_grad()
    def _after_router(self, router, args, output) -> None:
        if not (self._inside and self._measure):
            return
        x = args[0]
        _, routing_map = output
        logits = F.linear(x.reshape(-1, x.size(-1)).float(), router.weight.float())  # [N, E], as the router's
        valid = self._valid
        num = valid.sum()
        scores = torch.softmax(logits, dim=-1)
        # Megatron's aux loss routes by the router's own top-k (not replayed routes) over the full softmax.
        own = torch.zeros_like(scores).scatter_(1, torch.topk(logits, self.topk, dim=1).indices, 1.0)
        per_expert = (own * valid[:, None]).sum(0)
        prob_sum = (scores * valid[:, None]).sum(0)
        aux = (prob_sum * per_expert).sum() * self.num_experts / (self.topk * num.clamp(min=1) ** 2)
        z = (torch.logsumexp(logits, dim=-1) ** 2 * valid).sum()
        dispatched = (routing_map.float() * valid[:, None]).sum(0)
        row = torch.cat([torch.stack([aux, torch.ones_like(aux), z, num]), dispatched]).double()
        if self._stats is None:
            self._stats = torch.zeros(self.num_layers, row.numel(), dtype=torch.float64, device=row.device)
        self._stats[router.layer_number - 1] += row

    # -- per-step metrics ------------------------------------------------------------------------------------
    def collect(self, device) -> dict[str, float]:
        """moe/* metrics of the training passes since the last call, then reset (definitions in docs/moe.md).
        Collective over the data- and pipeline-parallel groups (and tensor-parallel with sequence parallelism,
        where each rank routes its own slice of the tokens); one host sync."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        stats = self._stats
        if stats is None:
            stats = torch.zeros(self.num_layers, 4 + self.num_experts, dtype=torch.float64, device=device)
        self._stats = None
        if dist.is_initialized():
            groups = [parallel_state.get_data_parallel_group(), parallel_state.get_pipeline_model_parallel_group()]
            if self.sequence_parallel:
                groups.append(parallel_state.get_tensor_model_parallel_group())
            for group in groups:
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(stats, group=group)
        seen = stats[:, 1] > 0
        if not bool(seen.any()):
            return {}
        s = stats[seen]
        counts = s[:, 4:]
        imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-12)
        values = torch.stack([(s[:, 0] / s[:, 1]).mean(), (s[:, 2] / s[:, 3].clamp(min=1)).mean(),
                              imbalance.mean(), imbalance.max()]).tolist()
        return dict(zip(("moe/aux_loss", "moe/z_loss", "moe/load_imbalance", "moe/load_imbalance_max"), values))
