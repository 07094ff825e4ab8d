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

    # With no answer in the expected format, take the last number in the response (lenient).
    fallback_last_number: bool = False
    # Numbers match within rel_tol * |reference|; 0 means exactly (as fractions: 0.5 == 1/2 == \frac{1}{2}).
    rel_tol: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rel_tol < 1.0:
            raise ValueError(f"math.rel_tol ({self.rel_tol}) must be in [0, 1)")


@dataclass
class CountdownRewardConfig:
    # meta keys of the offered numbers and the target (DataConfig.meta_keys must carry them)
    numbers_key: str = "numbers"
    target_key: str = "target"
    # False: each number at most once (the TV game); True: every number exactly once (TinyZero).
    require_all_numbers: bool = False
    # Without <answer>...</answer>, read the equation from the last non-empty line.
    allow_last_line: bool = True


@dataclass
class ExactMatchRewardConfig:
    # Which part of the response is compared: "auto" (the <answer> tag, else the last line), "answer_tag",
    # "last_line" or "full".
    extract: str = "auto"
    ignore_case: bool = True
    ignore_punctuation: bool = False

    def __post_init__(self) -> None:
        if self.extract not in EXACT_MATCH_EXTRACT:
            raise ValueError(f"exact_match.extract ({self.extract!r}) must be one of {EXACT_MATCH_EXTRACT}")


@dataclass
class RewardModelConfig:
    """A local HF AutoModelForSequenceClassification folder with num_labels=1 (and its tokenizer)."""

    path: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int = 8  # sequences per forward
    max_length: int = 4096  # tokens; longer inputs are cut from the left
    # Render prompt messages + response with the reward model's own chat template when it has one.
    use_chat_template: bool = True

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
    timeout_s: float = 30.0  # per connect and per read of one request
    max_retries: int = 3  # on connection errors, timeouts, HTTP 429 and 5xx
    backoff_s: float = 1.0  # wait before retry k: backoff_s * 2**k (capped, jittered)
    backoff_max_s: float = 30.0
    batch_size: int = 64  # samples per request; requests of one step run in parallel on the workers
    headers: dict[str, str] = field(default_factory=dict)

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
    # One of REWARD_NAMES:
    #   math / gsm8k / boxed: final-answer check against meta[answer_key]
    #   countdown: equation over meta[countdown.numbers_key] reaching meta[countdown.target_key]
    #   exact_match: normalised text equality with meta[answer_key]
    #   reward_model: scalar logit of a sequence-classification model (reward_model.*)
    #   function: a user function fn(prompt_text, response_text, meta) -> float named by function_path
    #   remote: an HTTP service (remote.*)
    name: str = "math"
    # meta key of the reference answer (PromptDataset stores the answer column as meta["answer"])
    answer_key: str = "answer"
    # Verifier scores: right answer / well-formed but wrong answer / no answer in the expected format.
    correct_score: float = 1.0
    format_score: float = 0.0
    incorrect_score: float = 0.0
    # reward = clip(scale * raw score, clip_min, clip_max)
    scale: float = 1.0
    clip_min: float | None = None
    clip_max: float | None = None
    # Reward given, as is (not scaled), when the reward function raises or times out.
    fallback_reward: float = 0.0
    # Worker threads that run reward calls; 0 runs them inline in the caller (then timeout_s must be None).
    num_workers: int = 4
    # A call running longer than this is abandoned and gets the fallback reward; None waits forever.
    timeout_s: float | None = 60.0
    # Tracebacks of the first this-many failures are logged; later ones are only counted.
    max_logged_errors: int = 3
    # "package.module:function" or "path/to/file.py:function", for name="function"
    function_path: str | None = None
    math: MathRewardConfig = field(default_factory=MathRewardConfig)
    countdown: CountdownRewardConfig = field(default_factory=CountdownRewardConfig)
    exact_match: ExactMatchRewardConfig = field(default_factory=ExactMatchRewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)

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
        if self.max_logged_errors < 0:
            raise ValueError(f"max_logged_errors ({self.max_logged_errors}) must be >= 0")
