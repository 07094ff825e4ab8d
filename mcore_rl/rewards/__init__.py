"""Rewards: pure-Python verifiers (math answers, countdown, exact match), a reward-model scorer, user functions,
an HTTP reward client, and the RewardManager that applies one of them to Samples without letting it fail the run.
"""

from mcore_rl.rewards.countdown import countdown_reward, extract_equation, grade_countdown
from mcore_rl.rewards.exact_match import exact_match_reward, grade_exact_match
from mcore_rl.rewards.function import load_function
from mcore_rl.rewards.grading import Grade, Scores
from mcore_rl.rewards.manager import RewardFn, RewardManager, build_reward_fn
from mcore_rl.rewards.math_answer import (
    answers_match,
    extract_boxed,
    extract_gsm8k_answer,
    grade_math,
    math_reward,
    parse_number,
)
from mcore_rl.rewards.safe_eval import UnsafeExpression, safe_eval_arithmetic

__all__ = [
    "Grade",
    "RewardFn",
    "RewardManager",
    "Scores",
    "UnsafeExpression",
    "answers_match",
    "build_reward_fn",
    "countdown_reward",
    "exact_match_reward",
    "extract_boxed",
    "extract_equation",
    "extract_gsm8k_answer",
    "grade_countdown",
    "grade_exact_match",
    "grade_math",
    "load_function",
    "math_reward",
    "parse_number",
    "safe_eval_arithmetic",
]
