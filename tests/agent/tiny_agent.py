"""A tiny model that really calls tools: the random tiny qwen2 of mcore_rl.testing, with <tool_call> and
</tool_call> added to its tokenizer as single special tokens, trained on CPU (a few seconds) to memorise scripted
trajectories. Greedy decoding then replays them through the real SGLang engine, so the multi-turn rollout is
exercised by model-generated calls, not by a stand-in policy. Also the test tools (raise, hang, add)."""

from __future__ import annotations

import time

from mcore_rl.agent.tools import Tool, ToolResult

CALL = '<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
REPLY_FORMAT = "<|end|><|tool|>{reply}<|end|><|assistant|>"


class Add(Tool):
    name, description, timeout_s = "add", "a + b", 5.0
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}

    def __init__(self, **kwargs):
        pass

    def run(self, arguments: dict) -> ToolResult:
        try:
            return ToolResult(str(int(arguments["a"]) + int(arguments["b"])))
        except Exception as e:
            return ToolResult(f"{type(e).__name__}: {e}", error="bad_arguments")


class Boom(Tool):
    name, description, timeout_s = "boom", "always raises", 5.0
    parameters = {"type": "object", "properties": {}}

    def __init__(self, **kwargs):
        pass

    def run(self, arguments: dict) -> ToolResult:
        raise RuntimeError("boom")


class Sleepy(Tool):
    name, description, timeout_s = "sleepy", "hangs far past its timeout", 1.0
    parameters = {"type": "object", "properties": {}}

    def __init__(self, **kwargs):
        pass

    def run(self, arguments: dict) -> ToolResult:
        time.sleep(3600)
        return ToolResult("never")


class Recorder(Tool):
    """Never called by the scripts; writes "closed" to `file` when the run closes it (Tool.close)."""
    name, description, timeout_s = "recorder", "records that it was closed", 1.0
    parameters = {"type": "object", "properties": {}}

    def __init__(self, file: str = "", **kwargs):
        self.file = file

    def run(self, arguments: dict) -> ToolResult:
        return ToolResult("ok")

    def close(self) -> None:
        with open(self.file, "a") as f:
            f.write("closed\n")


def make_tools() -> dict:
    return {t.name: t for t in (Add(), Boom(), Sleepy())}


# user message -> (model turn text, tool reply text) ... , final answer. The replies are what AgentRollout sends.
SCRIPTS = {
    "add two and three": [(CALL.format(name="add", args='{"a": 2, "b": 3}'), "5"), "five"],
    "explode": [(CALL.format(name="boom", args="{}"), "Error (exception): RuntimeError: boom"), "sorry"],
    "wait": [(CALL.format(name="sleepy", args="{}"), "Error (timeout): tool sleepy timed out after 1 s"), "late"],
    "broken": [('<tool_call>{"name": "add", "arguments": {</tool_call>', None), "oops"],
    "loop": [(CALL.format(name="add", args='{"a": 1, "b": 1}'), "2")] * 4 + ["two"],
    "hello": ["hi"],
}


def make_agent_model(path, steps: int = 400, seed: int = 0):
    """Write the trained tiny model under `path`; returns the path (str)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mcore_rl.agent.rollout import AgentRollout
    from mcore_rl.config.agent import AgentConfig
    from mcore_rl.testing import make_tiny_hf_model

    path = str(make_tiny_hf_model(path, "qwen2", seed=seed, vocab_size=512))
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tok.save_pretrained(path)
    enc = AgentRollout(AgentConfig(tools=["add"], reply_format=REPLY_FORMAT), tok, make_tools())
    seqs = []
    for user, script in SCRIPTS.items():
        ids = prompt_ids(tok, user)
        for step in script:
            if isinstance(step, str):
                ids += tok.encode(step, add_special_tokens=False) + [tok.eos_token_id]
            else:
                turn, reply = step
                ids += tok.encode(turn, add_special_tokens=False)
                if reply is None:  # the parse error AgentRollout sends back
                    from mcore_rl.agent.parser import parse_call

                    reply = "Error (malformed): " + parse_call('{"name": "add", "arguments": {', make_tools()).error
                ids += enc._before + enc._encode_reply(reply) + enc._after
        seqs.append(ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    width = max(map(len, seqs))
    x = torch.full((len(seqs), width), tok.pad_token_id)
    att = torch.zeros_like(x)
    for i, s in enumerate(seqs):
        x[i, :len(s)], att[i, :len(s)] = torch.tensor(s), 1
    labels = x.masked_fill(att == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        loss = model(input_ids=x, attention_mask=att, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path, safe_serialization=True)
    return path, float(loss.detach())


def prompt_ids(tok, user: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)
