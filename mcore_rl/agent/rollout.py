"""Multi-turn rollouts with tools over the RolloutEngine: many trajectories in flight, token ids in and out.

    agent = AgentRollout(cfg.agent, tokenizer, tools=build_tools(cfg.agent.tools))
    batch = agent.generate(engine, prompts, n=4, first_group_id=0)     # RolloutBatch, one Sample per trajectory

Each turn makes ONE engine.generate call for every active trajectory (SGLang batches them, and its radix cache
finds each trajectory's previous turns as a cached prefix). A turn ends at the end-of-call marker: by a stop
token id when the marker is a single token of the tokenizer, else the turn runs to EOS or its limit and its
tokens are cut right after the marker (found by decoding prefixes of the turn's tokens; the tokens themselves
are never re-encoded). The calls of a turn run concurrently (max_concurrent_tools threads, each call under its
own timeout; a call that hangs is abandoned and its reply is a timeout error). A reply becomes tokens by
tokenizing only the new text: the chat template's close of the assistant turn, the tool turn and the next
assistant header, split once into fixed ids around the reply (the reply itself tokenized with special tokens
split, so a tool cannot inject control tokens). Those ids are appended to the trajectory with mask 0.

A trajectory ends with an answer (a turn without a call), after agent.max_turns turns, or at
agent.max_response_tokens; Sample.agent (types.AgentTrace) records which, the turns and the tool calls.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from mcore_rl.agent.parser import ToolCall, ToolCallFormat, end_of_call, parse_tool_calls
from mcore_rl.config.agent import AgentConfig
from mcore_rl.rollout.seeds import sample_seed
from mcore_rl.types import AgentTrace, RolloutBatch, Sample, ToolCallRecord

logger = logging.getLogger(__name__)

REPLY = "{reply}"
POLL_S = 0.05
"""Longest wait of the tool and stream loops before they look at deadlines and the engine's health again."""
_PH_ASSISTANT, _PH_TOOL = "\x00ASSISTANT\x00", "\x00TOOLREPLY\x00"


@dataclass
class _Trajectory:
    prompt: list[int]
    group_id: int
    meta: dict
    prompt_text: str
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    trace: AgentTrace = field(default_factory=AgentTrace)
    finish: str = "stop"
    done: bool = False
    index: int = 0
    """Which of its group's n trajectories this is (with group_id and the turn: its sampling seed)."""

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        self.ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

    def end(self, reason: str, finish: str) -> None:
        self.trace.end_reason, self.finish, self.done = reason, finish, True


class AgentRollout:
    def __init__(self, cfg: AgentConfig, tokenizer, tools: dict[str, Any], *, record_inputs: bool = False):
        """tools: name -> Tool (mcore_rl.agent.tools). record_inputs: keep each turn's engine input ids in
        Sample.agent.turn_inputs (tests; it costs O(turns x length) memory)."""
        self.cfg, self.tokenizer, self.tools = cfg, tokenizer, dict(tools)
        self.record_inputs = record_inputs
        self.fmt = ToolCallFormat(cfg.call_start, cfg.call_end)
        end_ids = tokenizer.encode(cfg.call_end, add_special_tokens=False)
        self.end_token = end_ids[0] if len(end_ids) == 1 else None
        """The stop token id that ends a call's turn, or None: cut at the marker after generation."""
        before, _, after = reply_template(tokenizer, cfg.reply_format).partition(REPLY)
        self._before = tokenizer.encode(before, add_special_tokens=False)
        self._after = tokenizer.encode(after, add_special_tokens=False)
        self._turn_reward = None
        if cfg.turn_reward is not None:
            from mcore_rl.rewards.function import load_function

            self._turn_reward = load_function(cfg.turn_reward)

    def close(self) -> None:
        """Close every tool (Tool.close), each once, even if one of them raises; the first error is re-raised."""
        error = None
        for name, tool in self.tools.items():
            try:
                tool.close()
            except Exception as e:  # close the others first
                logger.error("closing tool %s failed: %s: %s", name, type(e).__name__, e)
                error = error or e
        self.tools = {}
        if error is not None:
            raise error

    # -- one step's rollouts ---------------------------------------------------------------------------------
    def generate(self, engine, prompts, n: int = 1, *, first_group_id: int = 0, seed_stream: str = "") -> RolloutBatch:
        """n trajectories per prompt (items with prompt_ids, meta, prompt_text), in prompt order; trajectories of
        prompt i share group_id first_group_id + i. Turn k of trajectory j of a group is sampled with seed
        seeds.sample_seed(rollout.random_seed, group_id, j, turn=k, stream=seed_stream), in either schedule."""
        trajs = [_Trajectory(list(p.prompt_ids), first_group_id + i, dict(p.meta), p.prompt_text, index=j)
                 for i, p in enumerate(prompts) for j in range(n)]
        base = engine.default_sampling()
        stops = tuple(base.stop_token_ids) + ((self.end_token,) if self.end_token is not None else ())
        sampling = engine.default_sampling(stop_token_ids=stops)
        version = (engine.weight_version, engine.policy_version)
        def seed(t: _Trajectory) -> int:  # of t's next turn
            return sample_seed(engine.cfg.random_seed, t.group_id, t.index, t.trace.num_turns, seed_stream)

        if self.cfg.schedule == "turn":
            self._by_turn(engine, trajs, sampling, seed)
        else:
            self._by_trajectory(engine, trajs, sampling, seed)
        samples = [Sample(prompt_ids=t.prompt, response_ids=t.ids, rollout_logprobs=t.logprobs,
                          finish_reason=t.finish, group_id=t.group_id, prompt_text=t.prompt_text, meta=t.meta,
                          response_mask=t.mask, agent=t.trace) for t in trajs]
        return RolloutBatch(samples=samples, weight_version=version[0], policy_version=version[1])

    def _by_turn(self, engine, trajs: list[_Trajectory], sampling, seed) -> None:
        """agent.schedule=turn: one engine call per turn over the active trajectories, then their tool calls."""
        for turn in range(self.cfg.max_turns):
            active = [t for t in trajs if not t.done]
            if not active:
                break
            inputs = [t.prompt + t.ids for t in active]
            batch = engine.generate(inputs, n=1, sampling=sampling, sampling_seeds=[seed(t) for t in active])
            pending: list[tuple[_Trajectory, ToolCall, str]] = []
            for t, inp, out in zip(active, inputs, batch.samples):
                if self.record_inputs:
                    t.trace.turn_inputs = (t.trace.turn_inputs or []) + [inp]
                call = self._take_turn(t, turn, out, sampling.max_new_tokens)
                if call is not None:
                    pending.append((t, call, self._turn_text(t)))
            replies = self._run_calls([c for _, c, _ in pending])
            for (t, call, turn_text), (text, record) in zip(pending, replies):
                self._take_reply(t, turn, turn_text, text, record)

    def _by_trajectory(self, engine, trajs: list[_Trajectory], sampling, seed) -> None:
        """agent.schedule=trajectory: every trajectory sends its next turn as soon as its own call has replied.
        One loop on this thread takes the engine's finished turns and the tools' replies from one queue."""
        events: queue.Queue = queue.Queue()
        runner = ToolRunner(self.cfg.max_concurrent_tools, self.cfg.tool_timeout_s, events)
        stream = engine.stream(sampling, lambda k, sample: events.put(("turn", k, sample)))
        waiting: dict[int, tuple[ToolCall, str]] = {}  # trajectory -> its call being run, and its turn's text
        try:
            def send(k: int) -> None:
                t = trajs[k]
                if self.record_inputs:
                    t.trace.turn_inputs = (t.trace.turn_inputs or []) + [t.prompt + t.ids]
                stream.submit(k, t.prompt + t.ids, sampling_seed=seed(t))

            for k in range(len(trajs)):
                send(k)
            active = len(trajs)
            while active:
                try:
                    kind, k, payload = events.get(timeout=min(runner.expire(), POLL_S))
                except queue.Empty:
                    error = stream.failed()
                    if error is not None:
                        raise error
                    continue
                t = trajs[k]
                if kind == "turn":
                    call = self._take_turn(t, t.trace.num_turns, payload, sampling.max_new_tokens)
                    if call is None:
                        active -= 1
                    elif not call.ok:
                        self._take_reply(t, t.trace.num_turns - 1, self._turn_text(t), *_malformed(call))
                        active -= self._go_on(t, k, send)
                    else:
                        waiting[k] = (call, self._turn_text(t))
                        runner.submit(k, self.tools[call.name], call.arguments)
                else:  # a tool's reply
                    call, turn_text = waiting.pop(k)
                    output, error, seconds = payload
                    text, record = _reply(call, output, error, seconds)
                    self._take_reply(t, t.trace.num_turns - 1, turn_text, text, record)
                    active -= self._go_on(t, k, send)
        finally:
            stream.close()

    @staticmethod
    def _go_on(t: _Trajectory, k: int, send) -> int:
        """After a reply: send trajectory k's next turn; 1 when the reply ended it instead (token budget)."""
        if t.done:
            return 1
        send(k)
        return 0

    def _turn_text(self, t: _Trajectory) -> str:
        return self.tokenizer.decode(t.ids[t.trace.turn_spans[-1][0]:])

    def _take_reply(self, t: _Trajectory, turn: int, turn_text: str, text: str, record: ToolCallRecord) -> None:
        """Record a call's reply and append it as mask-0 tokens, or end the trajectory if no room is left."""
        record.turn = turn
        t.trace.tool_calls.append(record)
        if self._turn_reward is not None:
            t.trace.turn_rewards.append(float(self._turn_reward(turn_text, text, t.meta)))
        reply_ids = self._before + self._encode_reply(text) + self._after
        if len(t.ids) + len(reply_ids) >= self.cfg.max_response_tokens:  # no room left for the model
            t.end("token_budget", "length")
        else:
            t.append(reply_ids, None)

    def _take_turn(self, t: _Trajectory, turn: int, out: Sample, max_new: int) -> ToolCall | None:
        """Append the turn's model tokens to `t`; the call to run, or None when the trajectory ended."""
        ids, lps = list(out.response_ids), list(out.rollout_logprobs)
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        cut = end_of_call(text, self.fmt)
        if cut >= 0 and (self.end_token is None or ids[-1] != self.end_token):
            k = _tokens_through(ids, self.tokenizer, self.cfg.call_end, text.find(self.cfg.call_start))
            ids, lps, text = ids[:k], lps[:k], self.tokenizer.decode(ids[:k], skip_special_tokens=False)
        room = self.cfg.max_response_tokens - len(t.ids)
        over_budget = len(ids) > room
        ids, lps = ids[:room], lps[:room]
        start = len(t.ids)
        t.append(ids, lps)
        t.trace.num_turns = turn + 1
        t.trace.turn_spans.append((start, len(t.ids)))
        if over_budget:
            t.end("token_budget", "length")
            return None
        if out.finish_reason == "abort":
            t.end("abort", "abort")
            return None
        calls = parse_tool_calls(text, self.tools.keys(), self.fmt)
        if not calls:
            if out.finish_reason == "length" and len(ids) >= max_new:
                t.end("turn_length", "length")
            else:
                t.end("answer", "stop")
            return None
        if turn + 1 >= self.cfg.max_turns:
            t.end("max_turns", "length")
            return None
        return calls[0]

    # -- tools -----------------------------------------------------------------------------------------------
    def _encode_reply(self, text: str) -> list[int]:
        text = text[:self.cfg.max_reply_chars]
        try:  # a tool's output is data: "<|im_end|>" in it must not become the control token
            return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        except TypeError:  # tokenizers without split_special_tokens
            return self.tokenizer.encode(text, add_special_tokens=False)

    def _run_calls(self, calls: list[ToolCall]) -> list[tuple[str, ToolCallRecord]]:
        """Each call's reply text and record. Malformed calls get their parse error without running anything;
        the others run in at most max_concurrent_tools threads, each under its timeout. A failed call's reply
        is "Error (<kind>): <message>", kind one of "malformed" and tools.ERROR_KINDS."""
        out: list[tuple[str, ToolCallRecord] | None] = [None] * len(calls)
        jobs = []
        for i, c in enumerate(calls):
            if c.ok:
                jobs.append(i)
            else:
                out[i] = _malformed(c)
        results = run_with_timeouts([(self.tools[calls[i].name], calls[i].arguments) for i in jobs],
                                    self.cfg.max_concurrent_tools, self.cfg.tool_timeout_s)
        for i, result in zip(jobs, results):
            out[i] = _reply(calls[i], *result)
        return out


def _malformed(call: ToolCall) -> tuple[str, ToolCallRecord]:
    return f"Error (malformed): {call.error}", ToolCallRecord(call.name, "malformed")


def _reply(call: ToolCall, output: str, error: str | None, seconds: float) -> tuple[str, ToolCallRecord]:
    """The reply text the model reads for a call that ran, and its record."""
    text = output if error is None else f"Error ({error}): {output}" if output else f"Error ({error})"
    return text, ToolCallRecord(call.name, error, seconds)


END_REASONS = ("answer", "max_turns", "token_budget", "turn_length", "abort")


def agent_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """agent/* metrics of one step's trajectories (those with Sample.agent; {} when there are none)."""
    traces = [(s, s.agent) for s in samples if s.agent is not None]
    if not traces:
        return {}
    num = len(traces)
    turns = [a.num_turns for _, a in traces]
    calls = [c for _, a in traces for c in a.tool_calls]
    m = {"agent/turns/mean": sum(turns) / num, "agent/turns/max": float(max(turns)),
         "agent/tool_calls": float(len(calls)), "agent/tool_calls/per_trajectory": len(calls) / num,
         "agent/malformed_calls": float(sum(c.error == "malformed" for c in calls)),
         "agent/tool_success": sum(any(c.error is None for c in a.tool_calls) for _, a in traces) / num,
         "agent/trajectory_length/mean": sum(len(s.response_ids) for s, _ in traces) / num,
         "agent/response_length/mean": sum(s.num_model_tokens for s, _ in traces) / num}
    for reason in END_REASONS:
        m[f"agent/end/{reason}"] = sum(a.end_reason == reason for _, a in traces) / num
    for name in sorted({c.name for c in calls if c.error != "malformed"}):
        mine = [c for c in calls if c.name == name and c.error != "malformed"]
        m[f"agent/tool/{name}/calls"] = float(len(mine))
        m[f"agent/tool/{name}/errors"] = float(sum(c.error is not None for c in mine))
        m[f"agent/tool/{name}/timeouts"] = float(sum(c.error == "timeout" for c in mine))
        m[f"agent/tool/{name}/seconds_mean"] = sum(c.seconds for c in mine) / len(mine)
    rewarded = [sum(a.turn_rewards) for _, a in traces if a.turn_rewards]
    if rewarded:
        m["agent/turn_reward/mean"] = sum(rewarded) / num
    return m


class ToolRunner:
    """Tool calls on daemon threads, at most max_concurrent at a time, each under its timeout (timeout_s, or the
    tool's own timeout_s). Results go to `results` as ("tool", job, (output, error kind or None, seconds)).

    A call that hangs past its timeout is abandoned (its slot is freed, its late result ignored; the thread is a
    daemon, so it cannot keep the process from exiting): call expire() at least every POLL_S while waiting."""

    def __init__(self, max_concurrent: int, timeout_s: float | None, results: queue.Queue):
        self.max_concurrent, self.timeout_s, self.results = max_concurrent, timeout_s, results
        self._todo: deque = deque()
        self._running: dict[Any, tuple[float, float, str]] = {}  # job -> (deadline, limit, tool name)
        self._lock = threading.Lock()

    def submit(self, job, tool, arguments: dict) -> None:
        with self._lock:
            self._todo.append((job, tool, arguments))
        self._start()

    def _start(self) -> None:
        with self._lock:
            while self._todo and len(self._running) < self.max_concurrent:
                job, tool, arguments = self._todo.popleft()
                limit = self.timeout_s if self.timeout_s is not None else float(getattr(tool, "timeout_s", 10.0))
                self._running[job] = (time.monotonic() + limit, limit, tool.name)
                threading.Thread(target=self._work, args=(job, tool, arguments), daemon=True,
                                 name=f"tool-{tool.name}").start()

    def _work(self, job, tool, arguments: dict) -> None:
        t0 = time.monotonic()
        try:
            r = tool.run(arguments)
            res = (str(r.output), r.error, time.monotonic() - t0)
        except BaseException as e:  # a tool that raises is an error reply, never a failed rollout
            res = (f"{type(e).__name__}: {e}", "exception", time.monotonic() - t0)
        with self._lock:
            if self._running.pop(job, None) is None:
                return  # timed out already: its timeout reply went out
            self.results.put(("tool", job, res))
        self._start()

    def expire(self) -> float:
        """Time out the calls past their deadline; the seconds until the next deadline (POLL_S if none)."""
        now = time.monotonic()
        expired = []
        with self._lock:
            for job, (deadline, limit, name) in list(self._running.items()):
                if now >= deadline:
                    del self._running[job]
                    expired.append((job, limit, name))
            nearest = min((d for d, _, _ in self._running.values()), default=now + POLL_S)
        for job, limit, name in expired:
            logger.warning("tool %s timed out after %g s; its thread is abandoned", name, limit)
            self.results.put(("tool", job, (f"tool {name} timed out after {limit:g} s", "timeout", limit)))
        if expired:
            self._start()
        return max(0.0, nearest - time.monotonic())


def run_with_timeouts(jobs: list[tuple[Any, dict]], max_concurrent: int,
                      timeout_s: float | None) -> list[tuple[str, str | None, float]]:
    """Run tool.run(arguments) for each (tool, arguments) through a ToolRunner; (output, error kind or None,
    seconds) per job, in order."""
    results: list[tuple[str, str | None, float] | None] = [None] * len(jobs)
    finished: queue.Queue = queue.Queue()
    runner = ToolRunner(max_concurrent, timeout_s, finished)
    for i, (tool, arguments) in enumerate(jobs):
        runner.submit(i, tool, arguments)
    left = len(jobs)
    while left:
        try:
            _, i, res = finished.get(timeout=min(runner.expire(), POLL_S))
        except queue.Empty:
            continue
        results[i] = res
        left -= 1
    return results


def _tokens_through(ids: list[int], tokenizer, marker: str, call_start: int) -> int:
    """The fewest leading tokens of `ids` whose text contains the first `marker` after position call_start of
    the turn's text (binary search: containment only grows with more tokens)."""
    def has(k: int) -> bool:
        return tokenizer.decode(ids[:k], skip_special_tokens=False).find(marker, max(call_start, 0)) >= 0

    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if has(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def reply_template(tokenizer, reply_format: str | None) -> str:
    """The text after a model's tool call up to where the model speaks again, with {reply} for the tool's
    output: reply_format, or the chat template's delta between [user, assistant(call)] and [user,
    assistant(call), tool(reply)] + the generation prompt."""
    if reply_format is not None:
        return reply_format
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template to derive tool replies from: set agent.reply_format "
                         "(a string with {reply})")
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": _PH_ASSISTANT}]
    full = tokenizer.apply_chat_template(msgs + [{"role": "tool", "content": _PH_TOOL}], tokenize=False,
                                         add_generation_prompt=True)
    a, r = full.find(_PH_ASSISTANT), full.find(_PH_TOOL)
    if a < 0 or r < a:
        raise ValueError("could not find the tool reply's place in the tokenizer's chat template (does it render a "
                         "'tool' message?): set agent.reply_format (a string with {reply})")
    return full[a + len(_PH_ASSISTANT):r] + REPLY + full[r + len(_PH_TOOL):]
