"""Final-answer checking for math: extract the answer from a response and compare it with the reference.

Extraction: GSM8K style (the text after the last "####"), LaTeX `\\boxed{...}` (the last one, nested braces
allowed), and optionally the last number in the response. Comparison: when both sides read as numbers they are
compared exactly as fractions, after dropping thousands commas, spaces, "$", "%", a trailing ".", and reading
"1/2", "\\frac{1}{2}" and "0.5" alike; otherwise the normalised strings must be equal.
"""

from __future__ import annotations

import re
from fractions import Fraction

from mcore_rl.rewards.grading import DEFAULT_SCORES, Grade, Scores

_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_SLASH_FRACTION = re.compile(r"([+-]?\d+)/(\d+)")
_LATEX_FRACTION = re.compile(r"([+-]?)\\[dt]?frac(?:\{([+-]?\d+)\}\{(\d+)\}|(\d)(\d))")
# a number inside running text: optional sign, digits with optional thousands commas, optional decimals, or a/b
_NUMBER_IN_TEXT = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_EXTRACTORS = ("auto", "gsm8k", "boxed")


def extract_gsm8k_answer(text: str) -> str | None:
    """The answer after the last "####": the whole rest of that line if it reads as a number, else its first
    number, else the stripped rest of the line (None when "####" is absent or followed by nothing)."""
    at = text.rfind("####")
    if at < 0:
        return None
    segment = text[at + 4 :].split("\n", 1)[0].strip()
    if not segment:
        return None
    if parse_number(segment) is not None:
        return segment
    match = _NUMBER_IN_TEXT.search(segment)
    return match.group(0) if match else segment


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}` (nested braces matched); `\\boxed 5` also works.
    None when there is none or its braces never close."""
    at = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if at < 0:
        return None
    rest = text[at + (6 if text.startswith("\\boxed", at) else 5) :]
    if rest.startswith("{"):
        depth = 0
        for i, ch in enumerate(rest):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    content = rest[1:i].strip()
                    return content or None
        return None
    if rest[:1].isspace():
        token = rest.split(None, 1)
        return token[0].rstrip("$.") if token else None
    return None  # e.g. "\boxedfoo": not a boxed answer


def extract_last_number(text: str) -> str | None:
    matches = _NUMBER_IN_TEXT.findall(text)
    return matches[-1] if matches else None


def parse_number(text: str) -> Fraction | None:
    """The exact value of a number written in one of the usual ways, or None if `text` is not just a number."""
    s = re.sub(r"\\[,!; ]|\\\$|\s|\$|\\%|%", "", text.replace("\u2212", "-")).rstrip(".")
    s = s.replace("{,}", "")  # LaTeX thousands separator 1{,}000
    if s.startswith("\\left(") or s.startswith("("):
        return None  # tuples and intervals are not numbers
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if _DECIMAL.fullmatch(s):
        return Fraction(s)
    match = _SLASH_FRACTION.fullmatch(s)
    if match and int(match.group(2)) != 0:
        return Fraction(int(match.group(1)), int(match.group(2)))
    match = _LATEX_FRACTION.fullmatch(s)
    if match:
        sign, num, den = match.group(1), match.group(2) or match.group(4), match.group(3) or match.group(5)
        if int(den) != 0:
            value = Fraction(int(num), int(den))
            return -value if sign == "-" else value
    return None


def normalize_answer_text(text: str) -> str:
    """Loose string form for non-numeric answers: no spaces, "$", "\\text{}" wrappers, \\left/\\right, trailing "."."""
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    s = re.sub(r"\\left|\\right|\\!|\\,|\\;|\$|\s", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.rstrip(".")


def reference_answer(answer: str) -> str:
    """The gold answer itself, also when a dataset stores a full GSM8K solution ("... #### 72") or a boxed one."""
    for extract in (extract_gsm8k_answer, extract_boxed):
        found = extract(answer)
        if found is not None:
            return found
    return answer.strip()


def answers_match(predicted: str, reference: str, rel_tol: float = 0.0) -> bool:
    """Exact numeric equality when both read as numbers (within rel_tol * |reference| if rel_tol > 0), else
    equality of the normalised strings."""
    p, r = parse_number(predicted), parse_number(reference)
    if p is not None and r is not None:
        if rel_tol > 0:
            return abs(p - r) <= Fraction(rel_tol) * abs(r)
        return p == r
    return normalize_answer_text(predicted) == normalize_answer_text(reference)


def grade_math(
    response: str, answer: str, *, extract: str = "auto", fallback_last_number: bool = False, rel_tol: float = 0.0
) -> Grade:
    """Grade a response against a reference answer.

    extract: "gsm8k" reads only "#### N", "boxed" only \\boxed{...}, "auto" tries \\boxed then "####".
    fallback_last_number: when that finds nothing, take the last number in the response (lenient; such an
    answer counts as well-formed, so a wrong one earns the format score).
    """
    if extract not in _EXTRACTORS:
        raise ValueError(f"extract ({extract!r}) must be one of {_EXTRACTORS}")
    found = None
    if extract in ("auto", "boxed"):
        found = extract_boxed(response)
    if found is None and extract in ("auto", "gsm8k"):
        found = extract_gsm8k_answer(response)
    if found is None and fallback_last_number:
        found = extract_last_number(response)
    if found is None:
        return Grade.NO_ANSWER
    return Grade.CORRECT if answers_match(found, reference_answer(answer), rel_tol) else Grade.WRONG


def math_reward(
    response: str,
    answer: str,
    *,
    extract: str = "auto",
    fallback_last_number: bool = False,
    rel_tol: float = 0.0,
    scores: Scores = DEFAULT_SCORES,
) -> float:
    """`grade_math` turned into a reward: scores.correct / scores.format (wrong) / scores.incorrect (no answer)."""
    return scores(
        grade_math(response, answer, extract=extract, fallback_last_number=fallback_last_number, rel_tol=rel_tol)
    )
