"""Broken user reward functions for the bad-input suite (reward.name=function, loaded by dotted path)."""


def raises(prompt_text: str, response_text: str, meta: dict) -> float:
    raise ZeroDivisionError("this reward function is broken on purpose")


def nan(prompt_text: str, response_text: str, meta: dict) -> float:
    return float("nan")
