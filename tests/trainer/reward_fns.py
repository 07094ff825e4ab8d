"""Reward functions for end-to-end tests, loaded by dotted path (reward.name=function).

A tiny random model never answers arithmetic, so a verifier would give every sample 0 and GRPO nothing to learn
from; this one varies with the sampled text, which is all the plumbing tests need.
"""


def text_length(prompt_text: str, response_text: str, meta: dict) -> float:
    return len(response_text) / 50.0
