"""A reward function of the runtime-fault suite (reward.name=function, loaded by dotted path).

`overflowing`: finite scores (the reward manager accepts them) whose sum over a group overflows float32: the
group's mean is inf and GRPO's advantages (score - mean) / std are nan, so the loss and its gradient are nan, as
with any reward on a scale the advantage arithmetic cannot hold.
"""


def overflowing(prompt_text: str, response_text: str, meta: dict) -> float:
    return 1e38
