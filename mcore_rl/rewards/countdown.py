"""Countdown: reach a target number with + - * / and parentheses over a given list of numbers.

Rules checked here (those of the TV game and of TinyZero's countdown task):
- the equation is the content of the last <answer>...</answer> in the response; if there is none and
  `allow_last_line`, the last non-empty line. A trailing "= 82" (or a leading "82 =") is ignored, as are
  ×, ÷ and − written as Unicode.
- only the given numbers appear as literals, each at most as often as it is given (a number given twice may be
  used twice); `require_all_numbers=True` (TinyZero's rule) demands every number exactly once. Numbers may not be
  glued together ("2" and "5" do not make 25) and unary minus is not allowed.
- intermediate fractions are fine; the value is computed exactly (`safe_eval_arithmetic`, no `eval`) and must
  equal the target. Division by zero makes the answer wrong.
Grades: no parsable equation -> NO_ANSWER; a parsable equation that breaks the number rules or misses the
target -> WRONG; otherwise CORRECT.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

from mcore_rl.rewards.grading import DEFAULT_SCORES, Grade, Scores
from mcore_rl.rewards.safe_eval import UnsafeExpression, literal_numbers, safe_eval_arithmetic

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_UNICODE_OPS = str.maketrans({"×": "*", "·": "*", "÷": "/", "−": "-", "–": "-"})


def extract_answer_tag(text: str) -> str | None:
    """Stripped content of the last <answer>...</answer>, or None."""
    matches = _ANSWER_TAG.findall(text)
    return matches[-1].strip() if matches else None


def extract_equation(response: str, allow_last_line: bool = True) -> str | None:
    """The expression part of the model's answer (see the module docstring), or None when there is none."""
    text = extract_answer_tag(response)
    if text is None and allow_last_line:
        lines = [line for line in response.splitlines() if line.strip()]
        text = lines[-1] if lines else None
    if not text:
        return None
    text = text.translate(_UNICODE_OPS).replace("\\times", "*").replace("\\div", "/").strip().strip("$").rstrip(".")
    parts = [part.strip() for part in text.split("=")]
    if len(parts) > 1:  # "expr = 82" or "82 = expr": keep the side that combines more than one number
        for part in parts:
            try:
                if len(literal_numbers(part)) > 1:
                    return part
            except UnsafeExpression:
                continue
    return parts[0]


def grade_countdown(
    response: str,
    numbers: Sequence[int],
    target: int | float,
    *,
    require_all_numbers: bool = False,
    allow_last_line: bool = True,
) -> Grade:
    """Grade a countdown response under the rules of the module docstring."""
    equation = extract_equation(response, allow_last_line)
    if equation is None:
        return Grade.NO_ANSWER
    try:
        used = literal_numbers(equation)
        value = safe_eval_arithmetic(equation, allow_unary=False)
    except UnsafeExpression:
        return Grade.NO_ANSWER
    except ZeroDivisionError:
        return Grade.WRONG
    given = Counter(Fraction(n) for n in numbers)
    counts = Counter(used)
    if any(counts[n] > given[n] for n in counts):
        return Grade.WRONG
    if require_all_numbers and counts != given:
        return Grade.WRONG
    return Grade.CORRECT if value == Fraction(target) else Grade.WRONG


def countdown_reward(
    response: str,
    numbers: Sequence[int],
    target: int | float,
    *,
    require_all_numbers: bool = False,
    allow_last_line: bool = True,
    scores: Scores = DEFAULT_SCORES,
) -> float:
    """`grade_countdown` turned into a reward: scores.correct / scores.format (wrong) / scores.incorrect."""
    grade = grade_countdown(
        response, numbers, target, require_all_numbers=require_all_numbers, allow_last_line=allow_last_line
    )
    return scores(grade)
