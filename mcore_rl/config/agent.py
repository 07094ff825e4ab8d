"""Multi-turn, tool-using rollouts of an rl task (mcore_rl/agent/rollout.py, docs/agent.md).

    agent: {tools: [calculator, python], max_turns: 4, max_response_tokens: 1024}
    tasks: [{name: tools, kind: rl, agent: {tools: [calculator]}, ...}]

`agent: null` (the default) is the single-turn rollout, unchanged. With an agent node the task's prompts start
trajectories in which the model may call tools: each tool call ends a turn, the tool's reply is appended as
tokens the policy does not train on, and the model continues, until it answers without a call, runs out of turns
or of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class AgentConfig:
    tools: list[Any] = field(default_factory=list)
    """The tools the model may call (mcore_rl.agent.tools.build_tools): "calculator", "python", or
    {path: "pkg.module:Class", ...its keyword arguments} for a Tool of your own."""
    schedule: str = "turn"
    """How trajectories advance. turn: every turn is one engine call over all trajectories still active, and
    the next turn starts when every tool call of this one has replied (batch composition, and so sampling, is
    reproducible: the resume guarantees hold). trajectory: each trajectory sends its next turn as soon as its
    own tool replies (RolloutEngine.stream), so a slow tool or a long turn holds up nobody else; faster when
    turns and tools vary, but which requests SGLang batches together depends on timing, so sampled runs are
    not reproducible unless the engine samples per request with its own seed."""
    max_turns: int = 4
    """Model turns per trajectory (engine calls); a call in the last turn ends the trajectory unanswered
    (end reason max_turns)."""
    max_response_tokens: int = 1024
    """Token budget of a whole trajectory after the prompt: model tokens and tool-reply tokens together. Each
    turn generates at most rollout.max_new_tokens; a trajectory that reaches this budget ends (token_budget).
    Also the response length the length-normalised loss modes and DAPO's overlong penalty take for this task."""
    tool_timeout_s: float | None = None
    """Seconds a tool call may run before its reply becomes a timeout error; null = each tool's own timeout_s.
    A call that hangs is abandoned (its thread is a daemon), so it never stalls the rollout."""
    max_concurrent_tools: int = 8
    """Tool calls run at the same time (over all trajectories of a turn) in a thread pool of this size."""
    max_reply_chars: int = 4096
    """A tool's reply is cut to this many characters before it is tokenized (long outputs eat the budget)."""
    call_start: str = "<tool_call>"
    """Text that opens a tool call; the call is JSON {"name": ..., "arguments": {...}} (Hermes / Qwen style)."""
    call_end: str = "</tool_call>"
    """Text that closes a tool call and ends the turn. When it is one token of the tokenizer the engine stops on
    it (a stop token id); otherwise each turn runs to EOS or its limit and is cut after the marker."""
    reply_format: str | None = None
    """How a tool reply becomes text after the model's call: a string with {reply}, e.g.
    "<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{reply}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n";
    null = derived once from the tokenizer's chat template (its "tool" message and the next assistant header)."""
    tools_in_prompt: bool = True
    """Render the prompts with the tools' schemas (the chat template's `tools=` argument, as Qwen2.5/Qwen3 and
    other tool-calling models were trained): the template then describes the tools and the call format in the
    system turn. Templates that do not use `tools` ignore it. false = the prompts as the data gives them."""
    turn_reward: str | None = None
    """Optional per-turn reward: "pkg.module:function" called as f(turn_text, reply_text, meta) -> float after
    each tool call; the sum over the turns is added to the task's reward of the whole trajectory."""

    def __post_init__(self):
        if not self.tools:
            raise ValueError("agent.tools is empty: name at least one tool (calculator, python or "
                             "{path: pkg.module:Class}), or set agent=null for single-turn rollouts")
        if self.schedule not in ("turn", "trajectory"):
            raise ValueError(f"agent.schedule must be turn or trajectory, got {self.schedule!r}")
        if self.max_turns < 1:
            raise ValueError(f"agent.max_turns must be >= 1, got {self.max_turns}")
        if self.max_response_tokens < 1:
            raise ValueError(f"agent.max_response_tokens must be >= 1, got {self.max_response_tokens}")
        if self.tool_timeout_s is not None and self.tool_timeout_s <= 0:
            raise ValueError(f"agent.tool_timeout_s must be > 0 (or null: each tool's own), got {self.tool_timeout_s}")
        if self.max_concurrent_tools < 1:
            raise ValueError(f"agent.max_concurrent_tools must be >= 1, got {self.max_concurrent_tools}")
        if self.max_reply_chars < 1:
            raise ValueError(f"agent.max_reply_chars must be >= 1, got {self.max_reply_chars}")
        if not self.call_start or not self.call_end or self.call_start == self.call_end:
            raise ValueError(f"agent.call_start ({self.call_start!r}) and agent.call_end ({self.call_end!r}) must be "
                             "non-empty and differ")
        if self.reply_format is not None and "{reply}" not in self.reply_format:
            raise ValueError(f"agent.reply_format must contain {{reply}}, got {self.reply_format!r}")
        if self.turn_reward is not None and ":" not in self.turn_reward:
            raise ValueError(f"agent.turn_reward must be 'pkg.module:function', got {self.turn_reward!r}")
