"""Tool calls in a model's text: find them, check them, and say what is wrong with the ones that are malformed.

    calls = parse_tool_calls(text, tool_names={"calculator", "python"})     # ToolCallFormat() = Hermes / Qwen
    for c in calls:
        reply = tools[c.name].run(c.arguments) if c.error is None else c.error   # the model sees the error

The default format is the one Hermes and Qwen2.5 / Qwen3 chat templates teach their models: each call is a JSON
object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, several calls per turn
allowed. The markers are configurable (agent.call_start / agent.call_end). A malformed call (JSON that does not
parse, no name, a tool that does not exist, arguments that are not an object, no end marker) is a ToolCall with
`error` set: the rollout sends that message back as the tool's reply instead of failing, so the model can learn
from it. Pure Python, no tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCallFormat:
    start: str = "<tool_call>"
    end: str = "</tool_call>"

    def __post_init__(self):
        if not self.start or not self.end:
            raise ValueError(f"tool-call markers must be non-empty, got start={self.start!r} end={self.end!r}")
        if self.start == self.end:
            raise ValueError(f"tool-call start and end markers must differ, both are {self.start!r}")


@dataclass
class ToolCall:
    """One call as the model wrote it: `raw` is the text between the markers."""

    name: str | None
    arguments: dict = field(default_factory=dict)
    raw: str = ""
    error: str | None = None
    """Why the call cannot run (a message for the model); None for a well-formed call of a known tool."""

    @property
    def ok(self) -> bool:
        return self.error is None


def parse_tool_calls(text: str, tool_names, fmt: ToolCallFormat = ToolCallFormat()) -> list[ToolCall]:
    """Every call in `text`, in order; [] when the text has no start marker (the turn is an answer).

    A start marker without a matching end marker is one malformed call (the model stopped mid-call)."""
    calls = []
    pos = 0
    while True:
        start = text.find(fmt.start, pos)
        if start < 0:
            return calls
        body_start = start + len(fmt.start)
        end = text.find(fmt.end, body_start)
        if end < 0:
            raw = text[body_start:]
            calls.append(ToolCall(None, raw=raw, error=f"tool call has no closing {fmt.end}"))
            return calls
        calls.append(parse_call(text[body_start:end], tool_names))
        pos = end + len(fmt.end)


def parse_call(raw: str, tool_names) -> ToolCall:
    """One call's JSON body -> ToolCall (error set when it is malformed)."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall(None, raw=raw, error=f"tool call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(obj, dict):
        return ToolCall(None, raw=raw, error=f"tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, raw=raw, error='tool call has no "name" (a string naming the tool)')
    known = sorted(tool_names)
    if name not in tool_names:
        return ToolCall(name, raw=raw, error=f"unknown tool {name!r}; available tools: {', '.join(known)}")
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name, raw=raw, error=f'"arguments" of {name} must be a JSON object, got '
                                             f"{type(arguments).__name__}")
    return ToolCall(name, arguments, raw=raw)


def end_of_call(text: str, fmt: ToolCallFormat = ToolCallFormat()) -> int:
    """The position just past the end marker that closes the first call in `text`, or -1 when no call is closed.

    The rollout ends a turn there (one call per turn): by a stop token when the end marker is one token, else
    by cutting the generated tokens after the fact (agent/rollout.py)."""
    start = text.find(fmt.start)
    if start < 0:
        return -1
    end = text.find(fmt.end, start + len(fmt.start))
    return -1 if end < 0 else end + len(fmt.end)
