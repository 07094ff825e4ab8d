"""Rollout routing replay (model.moe_routing_replay) and router statistics (moe/* metrics) on a tiny Qwen3-MoE
(4 experts, top-2; mcore_rl.testing), fp32: real SGLang 0.5.17 on CPU returns the routes, real Megatron-Core
(gloo, two processes; worker_moe_replay.py) replays them at EP2 and at PP2, transformers is the independent
reference.

* SGLang's routes are the trainer's own top-k on the same tokens (all of them here: fp32, no near-ties observed);
* with replay the trainer's log-probs equal SGLang's within LOGPROB_TOL, and the routers dispatch exactly the
  given routes; routes shifted by one expert change the log-probs, which then equal transformers' forced onto
  the same routes (LOGPROB_TOL); activation recompute (model.recompute=full) replays the same routes in backward
  (loss and grad norm equal within 1e-6 relative);
* moe/aux_loss equals the Switch loss computed from transformers' router logits per micro batch over real
  tokens, and Megatron's own aux-loss tracker, packed and padded (the engine passes the padding mask); moe/z_loss
  and moe/load_imbalance equal their definitions on transformers' logits; imbalance >= 1 (METRIC_RTOL);
* the aux and z losses reach the router gradients as coeff x token means over the pass, equal to transformers'
  autograd of that objective (GRAD_RTOL).

Run: nice -n 10 .venv/bin/python -m pytest tests/models/test_moe_replay.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.parallel.launcher import run_torchrun

HERE = Path(__file__).resolve().parent
LAYOUTS = [{"name": "ep2", "pp": 1, "ep": 2}, {"name": "pp2", "pp": 2, "ep": 1}]
LOGPROB_TOL = 1e-4  # fp32 on both sides; observed gaps are ~1e-6
METRIC_RTOL = 1e-5  # fp32 sums of a few hundred terms
WORLD = 2
NUM_NEW = 12

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from mcore_rl.config.rollout import RolloutConfig
    from mcore_rl.rollout import RolloutEngine
    from mcore_rl.testing import make_tiny_hf_model

    root = tmp_path_factory.mktemp("moe_replay")
    path = str(make_tiny_hf_model(root / "qwen3_moe", "qwen3_moe", seed=0))
    cfg = RolloutConfig(dtype="fp32", max_total_tokens=4096, request_batch_size=4, max_concurrent_requests=2,
                        startup_timeout_s=300.0, request_timeout_s=300.0, show_progress=False,
                        return_routed_experts=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 500, (int(n),), generator=g).tolist() for n in (5, 9, 7, 11)]
    with RolloutEngine(cfg, model_path=path) as engine:
        greedy = engine.generate(prompts, sampling=engine.default_sampling(
            temperature=0.0, max_new_tokens=NUM_NEW, ignore_eos=True)).samples
        sampled = engine.generate(prompts, sampling=engine.default_sampling(
            temperature=1.0, max_new_tokens=NUM_NEW, ignore_eos=True)).samples
    samples = greedy + sampled
    rollout = [{"prompt": s.prompt_ids, "response": s.response_ids, "logprobs": s.rollout_logprobs,
                "routes": s.routed_experts} for s in samples]
    torch.save(rollout, root / "rollout.pt")
    spec = {"model": path, "rollout": str(root / "rollout.pt"), "layouts": LAYOUTS}
    (root / "spec.json").write_text(json.dumps(spec))
    run_torchrun(HERE / "worker_moe_replay.py", WORLD, root / "spec.json", root / "out", timeout=900)
    by_layout: dict = {}
    for rank in range(WORLD):
        for c in json.loads((root / "out" / f"rank{rank}.json").read_text()):
            by_layout.setdefault(c["layout"], []).append(c)
    return {"path": path, "rollout": rollout, "results": by_layout}


class ForcedRoutes:
    """transformers' Qwen3-MoE with its routers' top-k replaced by given experts (weights: softmax over the
    router logits, renormalised over the given k as norm_topk_prob does); records the router logits."""

    def __init__(self, path):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.routes = None  # [N, L, K]
        self.logits: dict[int, torch.Tensor] = {}
        routers = [m for m in self.model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
        for layer, router in enumerate(routers):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer):
        def hook(router, args, output):
            logits = output[0]
            self.logits[layer] = logits.detach()
            if self.routes is None:
                return output
            idx = self.routes[:, layer].long()
            probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
            probs = probs / probs.sum(dim=-1, keepdim=True)
            return logits, probs.to(logits.dtype), idx
        return hook

    @torch.no_grad()
    def logprobs(self, ids, routes=None):
        self.routes = routes
        logits = self.model(torch.tensor([ids])).logits[0].float()
        self.routes = None
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return torch.cat([torch.zeros(1), lp])


def test_sglang_routes_are_the_trainers_own_topk(case):
    for name, ranks in case["results"].items():
        match = sum(r["own_match"][0] for r in ranks)
        total = sum(r["own_match"][1] for r in ranks)
        print(f"{name}: trainer's own top-k equals SGLang's on {match}/{total} (token, layer) pairs")
        assert total > 0 and match == total, (name, match, total)


def test_replayed_logprobs_equal_the_engines_and_use_the_given_routes(case):
    for name, ranks in case["results"].items():
        for r in ranks:
            print(f"{name} rank {r['rank']}: max |trainer - SGLang| log-prob: replay {r['replay_gap']:.2e}, "
                  f"own routing {r['own_gap']:.2e}")
            assert r["replay_gap"] < LOGPROB_TOL
            assert not r["used_mismatch"], (name, r["rank"], r["used_mismatch"])  # [layer, sample, tokens]
        layers = sorted(layer for r in ranks for layer in r["layers_seen"])
        assert set(layers) == set(range(4)), layers  # every layer was checked on some rank


def test_shifted_routes_change_logprobs_like_transformers_forced_onto_them(case):
    hf = ForcedRoutes(case["path"])
    rollout = case["rollout"]
    for name, ranks in case["results"].items():
        worst = moved = 0.0
        for r in ranks:
            for i, got in zip(r["samples"], r["shifted"]):
                s = rollout[i]
                ids = s["prompt"] + s["response"]
                routes = (s["routes"].long() + 1) % 4
                routes = torch.cat([routes, torch.arange(2).expand(1, *routes.shape[1:])])
                p = len(s["prompt"])
                want = hf.logprobs(ids, routes)[p:]
                worst = max(worst, float((torch.tensor(got) - want).abs().max()))
                moved = max(moved, float((torch.tensor(got) - torch.tensor(s["logprobs"])).abs().max()))
        print(f"{name}: shifted routes move log-probs by up to {moved:.3f}; |trainer - transformers| {worst:.2e}")
        assert moved > 1e-2 and worst < LOGPROB_TOL


def test_recompute_replays_the_same_routes(case):
    for name, ranks in case["results"].items():
        for r in ranks:
            (loss0, norm0), (loss1, norm1) = r["recompute"]["none"], r["recompute"]["full"]
            assert loss1 == pytest.approx(loss0, rel=1e-6) and norm1 == pytest.approx(norm0, rel=1e-6), r


def expected_metrics(hf: ForcedRoutes, rollout, groups, topk=2):
    """moe/* by their definitions (docs/moe.md) from transformers' router logits, real tokens only."""
    logits = {}  # sample -> {layer: [N, E]}
    for i, s in enumerate(rollout):
        hf.logprobs(s["prompt"] + s["response"])
        logits[i] = dict(hf.logits)
    layers = sorted(logits[0])
    aux, z, imbalance = [], [], []
    for layer in layers:
        per_mb = []
        for group in groups:
            x = torch.cat([logits[i][layer] for i in group]).double()
            scores = torch.softmax(x, dim=-1)
            counts = torch.zeros_like(scores).scatter_(1, x.topk(topk, dim=1).indices, 1.0).sum(0)
            n = x.size(0)
            per_mb.append(float((scores.sum(0) * counts).sum() * x.size(1) / (topk * n * n)))
        aux.append(sum(per_mb) / len(per_mb))
        x = torch.cat([logits[i][layer] for i in logits]).double()
        z.append(float((torch.logsumexp(x, dim=-1) ** 2).mean()))
        counts = torch.zeros_like(x).scatter_(1, x.topk(topk, dim=1).indices, 1.0).sum(0)
        imbalance.append(float(counts.max() / counts.mean()))
    return {"moe/aux_loss": sum(aux) / len(aux), "moe/z_loss": sum(z) / len(z),
            "moe/load_imbalance": sum(imbalance) / len(imbalance), "moe/load_imbalance_max": max(imbalance)}


def test_router_metrics_match_their_definitions(case):
    hf = ForcedRoutes(case["path"])
    rollout = case["rollout"]
    for name, ranks in case["results"].items():
        got = ranks[0]["metrics"]
        assert all(r["metrics"] == pytest.approx(got, rel=1e-12) for r in ranks)  # reduced: equal on every rank
        # pipeline stages hold the same micro batches: count each once
        groups = [list(g) for g in dict.fromkeys(tuple(g) for r in ranks for g in r["groups"])]
        want = expected_metrics(hf, rollout, groups)
        print(f"{name}: {got}")
        assert got == pytest.approx(want, rel=METRIC_RTOL)
        assert got["moe/load_imbalance"] >= 1.0
        assert all(r["after_reset"] == {} for r in ranks)
        packed = expected_metrics(hf, rollout, [[i] for i in range(len(rollout))])
        assert ranks[0]["metrics_packed"] == pytest.approx(packed, rel=METRIC_RTOL)
        if name == "ep2":  # Megatron's tracker: per layer, the sum over this rank's micro batches
            num_layers = len(ranks[0]["tracker"]["load_balancing_loss"])
            # packed, one sample a micro batch (no padding)
            total = sum(sum(r["tracker"]["load_balancing_loss"]) for r in ranks)
            mean = total / (num_layers * sum(len(r["samples"]) for r in ranks))
            assert mean == pytest.approx(ranks[0]["metrics_packed"]["moe/aux_loss"], rel=METRIC_RTOL)
            # padded, two samples a micro batch: the engine hands Megatron the padding mask, so the loss that
            # reaches the gradients counts real tokens only, as the metric does
            total = sum(sum(r["tracker_padded"]["load_balancing_loss"]) for r in ranks)
            mean = total / (num_layers * sum(len(r["groups"]) for r in ranks))
            assert mean == pytest.approx(got["moe/aux_loss"], rel=METRIC_RTOL)


AUX_COEFF, Z_COEFF = 0.01, 0.001  # worker_moe_replay.py's aux_engine
GRAD_RTOL = 1e-4  # fp32; per layer, max |diff| over the largest gradient element (observed 2.7e-7)


def hf_router_grads(path, rollout, groups, topk=2):
    """Gradients of transformers' router weights under the objective the engine's docs state for
    model.moe_aux_loss_coeff / moe_z_loss_coeff: per layer, AUX_COEFF x the token-weighted mean over micro
    batches of each one's Switch loss, plus Z_COEFF x the mean over all tokens of logsumexp(router logits)^2."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    logits: dict = {}
    current = [None]
    for layer, router in enumerate(routers):
        router.register_forward_hook(lambda mod, args, out, layer=layer: logits.__setitem__((current[0], layer),
                                                                                          out[0]))
    samples = sorted({i for g in groups for i in g})
    for i in samples:
        current[0] = i
        model(torch.tensor([rollout[i]["prompt"] + rollout[i]["response"]]))
    total = sum(logits[(i, 0)].size(0) for i in samples)
    loss = torch.zeros((), dtype=torch.float64)
    for layer in range(len(routers)):
        for g in groups:
            x = torch.cat([logits[(i, layer)] for i in g]).double()
            scores = torch.softmax(x, dim=-1)
            counts = torch.zeros_like(scores).scatter_(1, x.detach().topk(topk, dim=1).indices, 1.0).sum(0)
            n = x.size(0)
            switch = (scores.sum(0) * counts).sum() * x.size(1) / (topk * n * n)
            loss = loss + AUX_COEFF * (n / total) * switch
        x = torch.cat([logits[(i, layer)] for i in samples]).double()
        loss = loss + Z_COEFF * (torch.logsumexp(x, dim=-1) ** 2).sum() / total
    loss.backward()
    return {layer + 1: router.weight.grad for layer, router in enumerate(routers)}


def test_aux_and_z_losses_enter_the_gradients_as_token_means(case):
    """The routers' gradients from the aux and z losses alone (padded micro batches of two samples, DP2 x EP2 and
    PP2) equal transformers' autograd of the documented objective: the coefficient times a token mean, whatever
    the micro batches' sizes and padding (Megatron multiplies each micro batch's losses by its token count)."""
    for name, ranks in case["results"].items():
        groups = [list(g) for g in dict.fromkeys(tuple(g) for r in ranks for g in r["groups"])]
        want = hf_router_grads(case["path"], case["rollout"], groups)
        got = {}  # data-parallel ranks' own gradients summed (pipeline stages hold different layers)
        for r in ranks:
            for layer, grad in r["router_grads"].items():
                got[int(layer)] = got.get(int(layer), 0) + torch.tensor(grad, dtype=torch.float64)
        assert sorted(got) == sorted(want), name
        for layer, w in want.items():
            scale = w.abs().max().item()
            diff = (got[layer] - w).abs().max().item()
            print(f"{name} layer {layer}: max |grad| {scale:.3e}, max |diff| {diff:.3e}")
            assert scale > 0 and diff <= GRAD_RTOL * scale, (name, layer, diff, scale)
