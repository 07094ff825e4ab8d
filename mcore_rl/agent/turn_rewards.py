"""Per-turn rewards for agent tasks (`agent.turn_reward: mcore_rl.agent.turn_rewards:<name>`).

Each is called after every tool call as f(turn_text, reply_text, meta) -> float: the model's text of the turn
(ending with its call), the text the tool's reply became, and the prompt's meta. A failed call's reply is
"Error (<kind>): <message>" (AgentRollout), kind "malformed" (the call did not parse, or names no tool) or one
of mcore_rl.agent.tools.ERROR_KINDS. The sum over a trajectory's turns is added to its task reward.
"""

from __future__ import annotations

import re
from typing import Any

SUCCESS_BONUS = 0.2
WELL_FORMED_BONUS = 0.1
_KIND = re.compile(r"Error \(([a-z_]+)\)")


def error_kind(reply_text: str) -> str | None:
    """The error kind of a reply AgentRollout wrote for a failed call; None for a call that succeeded."""
    m = _KIND.match(reply_text)
    return m.group(1) if m else None


def successful_call(turn_text: str, reply_text: str, meta: dict[str, Any]) -> float:
    """SUCCESS_BONUS for a call that ran without error (well-formed, a known tool, valid arguments), else 0."""
    return SUCCESS_BONUS if error_kind(reply_text) is None else 0.0


def call_format(turn_text: str, reply_text: str, meta: dict[str, Any]) -> float:
    """A graded format reward for teaching a small model to call tools: SUCCESS_BONUS for a call that ran
    without error; WELL_FORMED_BONUS for a call that parsed and named a real tool which then refused its
    arguments or failed on them (bad_arguments, exception); 0 for malformed calls, timeouts and limits.

    Every call earns it, useful or not: keep agent.max_turns small, or the task's reward large next to it."""
    kind = error_kind(reply_text)
    if kind is None:
        return SUCCESS_BONUS
    return WELL_FORMED_BONUS if kind in ("bad_arguments", "exception") else 0.0
