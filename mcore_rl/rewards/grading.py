"""The three outcomes a verifier tells apart, and the configurable reward each one earns."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Grade(enum.Enum):
    CORRECT = "correct"  # an answer in the expected format, and right
    WRONG = "wrong"  # an answer in the expected format, but wrong -> format score
    NO_ANSWER = "no_answer"  # no usable answer in the expected format -> incorrect score


@dataclass(frozen=True)
class Scores:
    """Reward per grade. TinyZero-style shaping gives a small format score (e.g. 0.1) to well-formed wrong answers."""

    correct: float = 1.0
    format: float = 0.0
    incorrect: float = 0.0

    def __call__(self, grade: Grade) -> float:
        if grade is Grade.CORRECT:
            return self.correct
        return self.format if grade is Grade.WRONG else self.incorrect


DEFAULT_SCORES = Scores()
