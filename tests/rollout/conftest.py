"""Shared pieces of the rollout tests: two tiny models of one architecture (different seeds), HF references, and
a CPU RolloutConfig. Engines are started per test module (10-40 s each on the CPU machines)."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.config.rollout import RolloutConfig
from mcore_rl.testing import make_tiny_hf_model

# fp32 SGLang and HF logits agree to ~1e-6 (FACTS: log-probs within 4.8e-7). A greedy step whose top-2 gap is
# smaller than this may legitimately go either way in either engine, so reference prompts avoid such steps.
GREEDY_MARGIN = 1e-3
# Log-prob comparisons: 100x the observed fp32 gap, far below any real mismatch (a wrong weight moves log-probs
# by > 1e-2 on these models).
LOGPROB_TOL = 1e-4
NUM_NEW = 8


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rollout_models")
    return {name: str(make_tiny_hf_model(root / name, arch="qwen2", seed=seed))
            for name, seed in (("m0", 0), ("m1", 1))}


class HFReference:
    """HF transformers on the same checkpoint: greedy tokens, margins, and teacher-forced log-probs."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.path = path
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.no_grad()
    def logprobs(self, prompt: list[int], response: list[int]) -> torch.Tensor:
        """log p(response[t] | prompt, response[:t]) for every t: [len(response)] float32."""
        ids = torch.tensor([prompt + response])
        logp = self.model(ids).logits[0].float().log_softmax(-1)
        pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
        return logp[pos, torch.tensor(response)]

    @torch.no_grad()
    def greedy(self, prompt: list[int], num_new: int = NUM_NEW) -> tuple[list[int], float]:
        """HF generate's greedy tokens and the smallest top-2 log-prob gap along the way."""
        out = self.model.generate(torch.tensor([prompt]), max_new_tokens=num_new, min_new_tokens=num_new,
                                  do_sample=False, pad_token_id=1, output_scores=True, return_dict_in_generate=True)
        gaps = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
        return out.sequences[0, len(prompt):].tolist(), min(gaps)

    def stable_prompts(self, num: int = 4, num_new: int = NUM_NEW, seed: int = 0) -> list[tuple[list[int], list[int]]]:
        """`num` (prompt, greedy response) pairs whose greedy path has no near-tie (GREEDY_MARGIN)."""
        gen = torch.Generator().manual_seed(seed)
        found = []
        for _ in range(200):
            prompt = torch.randint(5, 500, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen).tolist()
            response, gap = self.greedy(prompt, num_new)
            if gap > GREEDY_MARGIN:
                found.append((prompt, response))
            if len(found) == num:
                return found
        raise AssertionError(f"fewer than {num} tie-free prompts for {self.path}")


@pytest.fixture(scope="session")
def hf(models) -> dict[str, HFReference]:
    return {name: HFReference(path) for name, path in models.items()}


def cpu_config(**overrides) -> RolloutConfig:
    base = dict(dtype="fp32", max_total_tokens=8192, request_batch_size=4, max_concurrent_requests=4,
                startup_timeout_s=300.0, request_timeout_s=300.0, show_progress=False)
    base.update(overrides)
    return RolloutConfig(**base)


def hf_weights(path: str) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(f"{path}/model.safetensors").items())


def buckets(named, num: int) -> list[list[tuple[str, torch.Tensor]]]:
    size = -(-len(named) // num)
    return [named[i:i + size] for i in range(0, len(named), size)]


def assert_matches_hf(engine, ref: HFReference, prompts) -> None:
    """Greedy tokens equal HF's, and the returned log-probs equal HF's teacher-forced ones (LOGPROB_TOL)."""
    sampling = engine.default_sampling(temperature=0.0, max_new_tokens=NUM_NEW, ignore_eos=True)
    batch = engine.generate([p for p, _ in prompts], sampling=sampling)
    for sample, (prompt, expected) in zip(batch.samples, prompts):
        assert sample.response_ids == expected, (prompt, sample.response_ids, expected)
        ref_lp = ref.logprobs(prompt, sample.response_ids)
        torch.testing.assert_close(torch.tensor(sample.rollout_logprobs), ref_lp, atol=LOGPROB_TOL, rtol=0)
