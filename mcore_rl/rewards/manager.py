"""RewardManager: score a list of Samples with the reward function named in RewardConfig, never failing the run.

    manager = RewardManager(cfg.reward)
    metrics = manager.score(batch.samples)   # fills sample.reward; {"reward/mean": ..., "reward/num_errors": ...}

A reward function that raises, returns something other than a finite number, or runs past `timeout_s` gives its
samples `fallback_reward`; such failures are counted (per sample) and the first `max_logged_errors` are logged
with their traceback. Other rewards are `clip(scale * raw, clip_min, clip_max)`.
"""

from __future__ import annotations

import logging
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from numbers import Real
from typing import Any

from mcore_rl.config.reward import RewardConfig
from mcore_rl.rewards.calls import CallResult, TimeoutPool
from mcore_rl.rewards.countdown import countdown_reward
from mcore_rl.rewards.exact_match import exact_match_reward
from mcore_rl.rewards.function import load_function
from mcore_rl.rewards.grading import Scores
from mcore_rl.rewards.math_answer import math_reward
from mcore_rl.types import Sample

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardFn:
    """Raw scores of a chunk of samples. Verifiers take chunks of one sample, so one failure costs one sample;
    a reward model or remote service takes a batch per call."""

    fn: Callable[[list[Sample]], list[float]]
    chunk_size: int


def build_reward_fn(cfg: RewardConfig) -> RewardFn:
    """The reward function that `cfg.name` stands for, with its settings bound."""
    scores = Scores(cfg.correct_score, cfg.format_score, cfg.incorrect_score)
    if cfg.name in ("math", "gsm8k", "boxed"):
        extract = {"math": "auto", "gsm8k": "gsm8k", "boxed": "boxed"}[cfg.name]
        verify = partial(
            math_reward,
            extract=extract,
            fallback_last_number=cfg.math.fallback_last_number,
            rel_tol=cfg.math.rel_tol,
            scores=scores,
        )
        return _per_sample(lambda s: verify(s.response_text, str(_meta(s, cfg.answer_key, "answer_key"))))
    if cfg.name == "countdown":
        c = cfg.countdown
        verify = partial(
            countdown_reward,
            require_all_numbers=c.require_all_numbers,
            allow_last_line=c.allow_last_line,
            scores=scores,
        )
        return _per_sample(
            lambda s: verify(
                s.response_text,
                _meta(s, c.numbers_key, "countdown.numbers_key"),
                _meta(s, c.target_key, "countdown.target_key"),
            )
        )
    if cfg.name == "exact_match":
        e = cfg.exact_match
        verify = partial(
            exact_match_reward,
            extract=e.extract,
            ignore_case=e.ignore_case,
            ignore_punctuation=e.ignore_punctuation,
            scores=scores,
        )
        return _per_sample(lambda s: verify(s.response_text, str(_meta(s, cfg.answer_key, "answer_key"))))
    if cfg.name == "function":
        assert cfg.function_path is not None, "RewardConfig checks this"
        user_fn = load_function(cfg.function_path)
        return _per_sample(lambda s: user_fn(s.prompt_text, s.response_text, s.meta))
    if cfg.name == "reward_model":
        from mcore_rl.rewards.reward_model import RewardModelScorer

        rm = cfg.reward_model
        assert rm.path is not None, "RewardConfig checks this"
        scorer = RewardModelScorer(
            rm.path,
            device=rm.device,
            dtype=rm.dtype,
            batch_size=rm.batch_size,
            max_length=rm.max_length,
            use_chat_template=rm.use_chat_template,
        )
        return RewardFn(scorer, rm.batch_size)
    if cfg.name == "remote":
        from mcore_rl.rewards.remote import RemoteReward

        r = cfg.remote
        assert r.url is not None, "RewardConfig checks this"
        client = RemoteReward(
            r.url,
            timeout_s=r.timeout_s,
            max_retries=r.max_retries,
            backoff_s=r.backoff_s,
            backoff_max_s=r.backoff_max_s,
            headers=dict(r.headers),
        )
        return RewardFn(client, r.batch_size)
    raise ValueError(f"reward name {cfg.name!r} has no builder")  # RewardConfig lists the names


class RewardError(ValueError):
    """A step's rewards failed beyond reward.max_error_fraction: the run stops (every rank, one line)."""


class RewardManager:
    def __init__(self, cfg: RewardConfig, reward_fn: RewardFn | None = None):
        """`reward_fn` replaces the one cfg.name builds (tests, or a function built in code)."""
        self.cfg = cfg
        self.reward_fn = reward_fn if reward_fn is not None else build_reward_fn(cfg)
        self._pool = TimeoutPool(cfg.num_workers) if cfg.num_workers > 0 else None
        self.num_errors_total = 0
        self.num_timeouts_total = 0
        self._num_logged = 0
        self._closed = False

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Set `sample.reward` on every sample; return this call's metrics."""
        if self._closed:
            raise RuntimeError("RewardManager.score() called after close()")
        size = self.reward_fn.chunk_size
        chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
        if self._pool is not None:
            results = self._pool.map(self.reward_fn.fn, chunks, self.cfg.timeout_s)
        else:
            results = [_call_inline(self.reward_fn.fn, chunk) for chunk in chunks]

        num_errors = num_timeouts = 0
        first_problem = None
        for chunk_index, (chunk, result) in enumerate(zip(chunks, results, strict=True)):
            raw, problem = _raw_rewards(result, len(chunk), self.cfg.timeout_s)
            if problem is None:
                rewards = [self._finish(r) for r in raw]
            else:
                first_problem = first_problem or problem
                if result.timed_out:
                    num_timeouts += len(chunk)
                else:
                    num_errors += len(chunk)
                self._log_failure(chunk_index, chunk, problem)
                rewards = [self.cfg.fallback_reward] * len(chunk)
            for sample, reward in zip(chunk, rewards, strict=True):
                sample.reward = reward

        self.num_errors_total += num_errors
        self.num_timeouts_total += num_timeouts
        if num_errors or num_timeouts:
            logger.warning(
                "reward %r: %d of %d samples failed (%d errors, %d timeouts) and got the fallback reward %s",
                self._name, num_errors + num_timeouts, len(samples), num_errors, num_timeouts,
                self.cfg.fallback_reward,
            )  # fmt: skip
        failed = num_errors + num_timeouts
        if samples and failed / len(samples) > self.cfg.max_error_fraction:
            raise RewardError(
                f"reward {self._name!r} failed on {failed} of the step's {len(samples)} samples ({num_errors} errors, "
                f"{num_timeouts} timeouts), more than reward.max_error_fraction ({self.cfg.max_error_fraction:g}) "
                f"allows. The first failure: {first_problem.strip().splitlines()[-1]}. Fix the reward, or set "
                "reward.max_error_fraction=1.0 to train on reward.fallback_reward for the samples it cannot score"
            )  # fmt: skip
        rewards_all = [s.reward for s in samples]
        return {
            "reward/mean": sum(rewards_all) / len(rewards_all) if rewards_all else 0.0,
            "reward/min": min(rewards_all, default=0.0),
            "reward/max": max(rewards_all, default=0.0),
            "reward/num_errors": float(num_errors),
            "reward/num_timeouts": float(num_timeouts),
        }

    @property
    def _name(self) -> str:
        """The reward as the user named it: a user function by its path."""
        return self.cfg.function_path if self.cfg.name == "function" else self.cfg.name

    def _finish(self, raw: float) -> float:
        reward = self.cfg.scale * raw
        if self.cfg.clip_min is not None:
            reward = max(self.cfg.clip_min, reward)
        if self.cfg.clip_max is not None:
            reward = min(self.cfg.clip_max, reward)
        return reward

    def _log_failure(self, chunk_index: int, chunk: list[Sample], problem: str) -> None:
        if self._num_logged >= self.cfg.max_logged_errors:
            return
        self._num_logged += 1
        first = chunk_index * self.reward_fn.chunk_size
        logger.warning(
            "reward %r failed on samples %d..%d (the first's prompt: %r), which get the fallback reward %s "
            "(failure %d of at most %d logged; see reward.fallback_reward):\n%s",
            self._name, first, first + len(chunk) - 1, chunk[0].prompt_text[:120], self.cfg.fallback_reward,
            self._num_logged, self.cfg.max_logged_errors, problem,
        )  # fmt: skip

    def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _per_sample(fn: Callable[[Sample], float]) -> RewardFn:
    return RewardFn(lambda chunk: [fn(s) for s in chunk], chunk_size=1)


def _meta(sample: Sample, key: str, setting: str) -> Any:
    if key not in sample.meta:
        raise KeyError(
            f"sample.meta has no {key!r} (it has {sorted(sample.meta)}); carry that column with data.meta_keys "
            f"or point reward.{setting} at the right key"
        )
    return sample.meta[key]


def _raw_rewards(result: CallResult, num_samples: int, timeout_s: float | None) -> tuple[list[float], str | None]:
    """The raw scores of a call, or the reason there are none (a traceback, a timeout, a bad return value)."""
    if result.timed_out:
        return [], f"timed out after {timeout_s}s"
    if result.error is not None:
        return [], result.traceback
    values = result.value
    if not isinstance(values, (list, tuple)) or len(values) != num_samples:
        return [], f"returned {values!r:.200} for {num_samples} samples; expected a list of {num_samples} floats"
    for v in values:
        if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v):
            return [], f"returned {v!r:.100}; expected a finite float"
    return [float(v) for v in values], None


def _call_inline(fn: Callable[[list[Sample]], list[float]], chunk: list[Sample]) -> CallResult:
    try:
        return CallResult(value=fn(chunk))
    except Exception as e:
        return CallResult(error=e, traceback=traceback.format_exc())
