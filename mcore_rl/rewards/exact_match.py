"""Exact-match grading of short text answers, after optional normalisation."""

from __future__ import annotations

import re
import string

from mcore_rl.rewards.countdown import extract_answer_tag
from mcore_rl.rewards.grading import DEFAULT_SCORES, Grade, Scores

EXTRACT_MODES = ("auto", "answer_tag", "last_line", "full")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def extract_text_answer(response: str, extract: str = "auto") -> str | None:
    """The part of the response to compare: "answer_tag" (last <answer>...</answer>), "last_line" (last
    non-empty line), "full" (everything), or "auto" (the answer tag if there is one, else the last line)."""
    if extract not in EXTRACT_MODES:
        raise ValueError(f"extract ({extract!r}) must be one of {EXTRACT_MODES}")
    if extract in ("auto", "answer_tag"):
        found = extract_answer_tag(response)
        if found is not None or extract == "answer_tag":
            return found
    if extract == "full":
        return response if response.strip() else None
    lines = [line for line in response.splitlines() if line.strip()]
    return lines[-1] if lines else None


def normalize_text(text: str, *, ignore_case: bool = True, ignore_punctuation: bool = False) -> str:
    """Whitespace collapsed and stripped; optionally lower-cased and without ASCII punctuation."""
    if ignore_case:
        text = text.lower()
    if ignore_punctuation:
        text = text.translate(_PUNCTUATION)
    return re.sub(r"\s+", " ", text).strip()


def grade_exact_match(
    response: str, answer: str, *, extract: str = "auto", ignore_case: bool = True, ignore_punctuation: bool = False
) -> Grade:
    found = extract_text_answer(response, extract)
    if found is None:
        return Grade.NO_ANSWER
    norm = dict(ignore_case=ignore_case, ignore_punctuation=ignore_punctuation)
    return Grade.CORRECT if normalize_text(found, **norm) == normalize_text(answer, **norm) else Grade.WRONG


def exact_match_reward(
    response: str,
    answer: str,
    *,
    extract: str = "auto",
    ignore_case: bool = True,
    ignore_punctuation: bool = False,
    scores: Scores = DEFAULT_SCORES,
) -> float:
    grade = grade_exact_match(
        response, answer, extract=extract, ignore_case=ignore_case, ignore_punctuation=ignore_punctuation
    )
    return scores(grade)
