"""Reward config: which reward function scores the samples, how its raw score becomes the reward, and how
failures are handled. Consumed by `mcore_rl.rewards.RewardManager`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import isfinite

REWARD_NAMES = ("math", "gsm8k", "boxed", "countdown", "exact_match", "reward_model", "function", "remote")
EXACT_MATCH_EXTRACT = ("auto", "answer_tag", "last_line", "full")
RM_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class MathRewardConfig:
    """For "math" (\\boxed{} then "####"), "gsm8k" ("####" only) and "boxed" (\\boxed{} only)."""

    fallback_last_number: bool = False
    """With no answer in the expected format, take the last number in the response (lenient; useful for small
    models that answer without \\boxed{} or "####")."""
    rel_tol: float = 0.0
    """Numbers match within rel_tol x |reference|, in [0, 1); 0 means exactly (as fractions: 0.5 == 1/2 ==
    \\frac{1}{2})."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.rel_tol < 1.0:
            raise ValueError(f"math.rel_tol ({self.rel_tol}) must be in [0, 1)")


@dataclass
class CountdownRewardConfig:
    numbers_key: str = "numbers"
    """meta key of the offered numbers (data.meta_keys must carry the column)."""
    target_key: str = "target"
    """meta key of the target number (data.meta_keys must carry the column)."""
    require_all_numbers: bool = False
    """false: each number at most once (the TV game); true: every number exactly once (TinyZero)."""
    allow_last_line: bool = True
    """Without <answer>...</answer>, read the equation from the last non-empty line (false: no answer)."""


@dataclass
class ExactMatchRewardConfig:
    extract: str = "auto"
    """Which part of the response is compared: auto (the <answer> tag, else the last line), answer_tag,
    last_line or full (the whole response)."""
    ignore_case: bool = True
    """Lower-case both sides before comparing (whitespace is always collapsed and stripped)."""
    ignore_punctuation: bool = False
    """Remove ASCII punctuation from both sides before comparing."""

    def __post_init__(self) -> None:
        if self.extract not in EXACT_MATCH_EXTRACT:
            raise ValueError(f"exact_match.extract ({self.extract!r}) must be one of {EXACT_MATCH_EXTRACT}")


@dataclass
class RewardModelConfig:
    """A local HF AutoModelForSequenceClassification folder with num_labels=1 (and its tokenizer)."""

    path: str | None = None
    """Local folder of the reward model; required with reward.name=reward_model."""
    device: str = "cpu"
    """torch device the reward model runs on (in global rank 0's process), e.g. cpu or cuda:1; put it on a GPU
    the trainer and SGLang leave room on."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16: the reward model's weights (bfloat16 halves its memory on a GPU)."""
    batch_size: int = 8
    """Sequences per forward of the reward model; lower it when scoring runs out of memory."""
    max_length: int = 4096
    """Tokens of prompt + response given to the reward model; longer inputs are cut from the left."""
    use_chat_template: bool = True
    """Render prompt messages + response with the reward model's own chat template when it has one; false (or
    no template): the policy's templated prompt text followed by the response text."""

    def __post_init__(self) -> None:
        if self.dtype not in RM_DTYPES:
            raise ValueError(f"reward_model.dtype ({self.dtype!r}) must be one of {RM_DTYPES}")
        if self.batch_size <= 0 or self.max_length <= 0:
            raise ValueError(
                f"reward_model.batch_size ({self.batch_size}) and max_length ({self.max_length}) must be positive"
            )


@dataclass
class RemoteRewardConfig:
    """An HTTP service: POST {"samples": [{"prompt", "response", "meta"}...]} -> {"rewards": [...]}."""

    url: str | None = None
    """http:// or https:// address the samples are POSTed to; required with reward.name=remote."""
    timeout_s: float = 30.0
    """Seconds allowed per connect and per read of one request (reward.timeout_s bounds the whole call)."""
    max_retries: int = 3
    """Retries of one request on connection errors, timeouts, HTTP 429 and 5xx (0 = try once); other HTTP
    errors fail at once."""
    backoff_s: float = 1.0
    """Seconds before retry k: backoff_s x 2**k, capped at backoff_max_s, times a random factor in [0.5, 1]."""
    backoff_max_s: float = 30.0
    """Cap of that wait, in seconds (>= backoff_s)."""
    batch_size: int = 64
    """Samples per request; the requests of one step run in parallel on reward.num_workers threads."""
    headers: dict[str, str] = field(default_factory=dict)
    """Extra HTTP headers of every request (e.g. Authorization), added to Content-Type: application/json."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"remote.timeout_s ({self.timeout_s}) must be positive")
        if self.max_retries < 0:
            raise ValueError(f"remote.max_retries ({self.max_retries}) must be >= 0")
        if self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError(
                f"need 0 <= remote.backoff_s ({self.backoff_s}) <= remote.backoff_max_s ({self.backoff_max_s})"
            )
        if self.batch_size <= 0:
            raise ValueError(f"remote.batch_size ({self.batch_size}) must be positive")


@dataclass
class RewardConfig:
    name: str = "math"
    """Which reward function scores the samples, one of:
    math / gsm8k / boxed: final-answer check against meta[answer_key] (math.*);
    countdown: an equation over meta[countdown.numbers_key] reaching meta[countdown.target_key] (countdown.*);
    exact_match: normalised text equality with meta[answer_key] (exact_match.*);
    reward_model: the scalar logit of a sequence-classification model (reward_model.*);
    function: a user function fn(prompt_text, response_text, meta) -> float named by function_path;
    remote: an HTTP service (remote.*)."""
    answer_key: str = "answer"
    """meta key of the reference answer (the prompt dataset stores its answer column as meta["answer"])."""
    correct_score: float = 1.0
    """Verifier rewards (math, gsm8k, boxed, countdown, exact_match): raw score of a right answer."""
    format_score: float = 0.0
    """Raw score of a well-formed but wrong answer (TinyZero-style shaping sets a small one, e.g. 0.1)."""
    incorrect_score: float = 0.0
    """Raw score of a response with no answer in the expected format."""
    scale: float = 1.0
    """reward = clip(scale x raw score, clip_min, clip_max), for every reward function."""
    clip_min: float | None = None
    """Lower bound of the reward after scaling; null = none."""
    clip_max: float | None = None
    """Upper bound of the reward after scaling; null = none (must be >= clip_min)."""
    fallback_reward: float = 0.0
    """Reward given, as is (not scaled or clipped), to the samples of a call that raises or times out; such
    failures are counted as reward/num_errors and reward/num_timeouts."""
    num_workers: int = 4
    """Worker threads that run reward calls; 0 runs them inline in the caller (then timeout_s must be null).
    Raise it for slow rewards (remote services, user functions)."""
    timeout_s: float | None = 60.0
    """Seconds a reward call may run before it is abandoned and its samples get fallback_reward; null waits
    forever."""
    max_error_fraction: float = 0.5
    """A step in which more than this share of the samples failed to be scored (errors, non-finite values,
    timeouts) stops the run with an error naming the reward and its first failure (RewardError): a reward that
    always fails is a bug, not noise, and fallback rewards would train on nothing. 1.0 never stops (the failed
    samples get fallback_reward, as below the bound)."""
    max_logged_errors: int = 3
    """Tracebacks of the first this-many failures are logged; later ones are only counted (0 = none logged)."""
    function_path: str | None = None
    """With name=function: "package.module:function" or "path/to/file.py:function"."""
    math: MathRewardConfig = field(default_factory=MathRewardConfig)
    """Settings of the math / gsm8k / boxed verifiers."""
    countdown: CountdownRewardConfig = field(default_factory=CountdownRewardConfig)
    """Settings of the countdown verifier."""
    exact_match: ExactMatchRewardConfig = field(default_factory=ExactMatchRewardConfig)
    """Settings of the exact_match verifier."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """With name=reward_model: the model and how it runs."""
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    """With name=remote: the service's address, batching and retries."""

    def __post_init__(self) -> None:
        if self.name not in REWARD_NAMES:
            raise ValueError(f"reward name {self.name!r} is unknown; choose one of {REWARD_NAMES}")
        if self.name == "function" and not self.function_path:
            raise ValueError("name='function' needs function_path, e.g. 'my_pkg.rewards:score'")
        if self.name == "reward_model" and not self.reward_model.path:
            raise ValueError("name='reward_model' needs reward_model.path (a local model folder)")
        if self.name == "remote" and not (self.remote.url or "").startswith(("http://", "https://")):
            raise ValueError(
                f"name='remote' needs remote.url starting with http:// or https://, got {self.remote.url!r}"
            )
        for key in ("correct_score", "format_score", "incorrect_score", "scale", "fallback_reward"):
            if not isfinite(getattr(self, key)):
                raise ValueError(f"{key} ({getattr(self, key)}) must be a finite number")
        if self.clip_min is not None and self.clip_max is not None and self.clip_min > self.clip_max:
            raise ValueError(f"clip_min ({self.clip_min}) is larger than clip_max ({self.clip_max})")
        if self.num_workers < 0:
            raise ValueError(f"num_workers ({self.num_workers}) must be >= 0")
        if self.timeout_s is not None:
            if self.timeout_s <= 0:
                raise ValueError(f"timeout_s ({self.timeout_s}) must be positive, or None for no timeout")
            if self.num_workers == 0:
                raise ValueError(
                    f"timeout_s ({self.timeout_s}) needs worker threads, but num_workers is 0; "
                    "set num_workers >= 1 or timeout_s=None"
                )
        if not 0.0 <= self.max_error_fraction <= 1.0:
            raise ValueError(f"max_error_fraction ({self.max_error_fraction}) must be in [0, 1] (1.0: never stop)")
        if self.max_logged_errors < 0:
            raise ValueError(f"max_logged_errors ({self.max_logged_errors}) must be >= 0")
