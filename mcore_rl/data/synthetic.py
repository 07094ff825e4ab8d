"""Seeded synthetic tasks for the CPU recipe and tests: arithmetic problems, DPO pairs built from them, countdown.

Rows use the default column names of DataConfig / PreferenceDataConfig ("prompt", "answer", "chosen",
"rejected"); countdown rows also carry "numbers" and "target" for `DataConfig.meta_keys`. The same arguments give
the same rows. `examples/make_arithmetic_data.py` writes them to jsonl.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ARITHMETIC_SUFFIX = "Give the final answer after ####."


def make_arithmetic_rows(
    num_rows: int,
    *,
    seed: int = 0,
    num_operands: int = 2,
    min_digits: int = 1,
    max_digits: int = 2,
    operators: str = "+-",
) -> list[dict[str, str]]:
    """Problems like "What is 23 + 48? Give the final answer after ####." with answer "71".

    Operands have between min_digits and max_digits digits (one digit: 0..9); operators are drawn from
    `operators` (any of "+-*"); the answer follows the usual precedence and can be negative.
    """
    if num_operands < 2:
        raise ValueError(f"num_operands ({num_operands}) must be at least 2")
    _check_problem_args(min_digits, max_digits, operators)
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        expr, value = _random_problem(rng, num_operands, min_digits, max_digits, operators)
        rows.append({"prompt": f"What is {expr}? {ARITHMETIC_SUFFIX}", "answer": str(value)})
    return rows


def make_preference_rows(num_rows: int, *, seed: int = 0, **arithmetic: Any) -> list[dict[str, str]]:
    """DPO pairs over arithmetic problems: chosen states the right answer, rejected a wrong one (off by 1..10)."""
    rng = random.Random(seed + 1)  # independent of the problem stream
    rows = []
    for row in make_arithmetic_rows(num_rows, seed=seed, **arithmetic):
        expr = row["prompt"].removeprefix("What is ").split("?")[0]
        right = int(row["answer"])
        wrong = right + rng.choice([-1, 1]) * rng.randint(1, 10)
        rows.append({
            "prompt": row["prompt"],
            "chosen": f"{expr} = {right}. #### {right}",
            "rejected": f"{expr} = {wrong}. #### {wrong}",
        })  # fmt: skip
    return rows


_SAFETY_REQUESTS = [
    "read my coworker's private messages without them knowing",
    "get into my neighbour's wifi network without asking",
    "find out where a stranger I saw online lives",
    "copy a paid course and share it for free",
    "make a fake doctor's note for school",
    "guess my ex's email password",
    "write a review of a restaurant I never visited to hurt it",
    "track my partner's phone location secretly",
]
_SAFETY_ASKS = ["How can I {}?", "Tell me how to {}.", "What is the easiest way to {}?", "I want to {}. Help me."]
_SAFETY_CHOSEN = [
    "I can't help with that: it would harm someone or break their trust. If there is a problem behind it, "
    "I'm happy to help you find a fair way to solve it.",
    "I won't help with this, because it affects another person without their consent. Is there something "
    "else I can help you with?",
]
_SAFETY_REJECTED = ["Sure! Here is how to {} step by step.", "Of course. To {}, start with the first step."]


TOOL_SYSTEM_PROMPT = ("You are a math assistant with a calculator tool. Call it as shown, read its result, then "
                      "answer after ####.")


def make_tool_arithmetic_rows(num_rows: int, *, seed: int = 0, min_digits: int = 2, max_digits: int = 2,
                              operators: str = "*", shots: int = 2, call_start: str = "<tool_call>",
                              call_end: str = "</tool_call>") -> list[dict[str, Any]]:
    """Problems a small model gets wrong in its head and right with the calculator tool (mcore_rl.agent):
    "What is 37 * 48?" with answer "1776", as chat messages: a system prompt, `shots` worked examples of the
    whole exchange (the model's call as `call_start{"name": "calculator", "arguments": {"expression": ...}}
    call_end`, the tool's reply, the answer after ####), then the question. The examples are what let a 135M
    model produce calls that run at all (SmolLM2-135M-Instruct, sampled at T=1: 1 in 64 samples after one
    example, 21 in 32 after two); RL then makes calling, and answering with the tool's result, the habit. Two
    operands; the examples are other problems of the same kind."""
    if shots < 0:
        raise ValueError(f"shots ({shots}) must be >= 0")
    _check_problem_args(min_digits, max_digits, operators)
    rng = random.Random(seed)

    def problem() -> tuple[str, int]:
        return _random_problem(rng, 2, min_digits, max_digits, operators)

    rows = []
    for _ in range(num_rows):
        messages = [{"role": "system", "content": TOOL_SYSTEM_PROMPT}]
        for _ in range(shots):
            shown, shown_value = problem()
            call = json.dumps({"name": "calculator", "arguments": {"expression": shown}})
            messages += [{"role": "user", "content": f"What is {shown}?"},
                         {"role": "assistant", "content": f"{call_start}{call}{call_end}"},
                         {"role": "tool", "content": str(shown_value)},
                         {"role": "assistant", "content": f"#### {shown_value}"}]
        asked, value = problem()
        rows.append({"prompt": messages + [{"role": "user", "content": f"What is {asked}?"}], "answer": str(value)})
    return rows


def make_safety_rows(num_rows: int, *, seed: int = 0) -> list[dict[str, str]]:
    """DPO pairs of a made-up safety policy: each prompt asks for something that harms another person; chosen
    declines politely, rejected starts to comply (with no actual instructions). For multi-task recipes."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        request = rng.choice(_SAFETY_REQUESTS)
        rows.append({"prompt": rng.choice(_SAFETY_ASKS).format(request), "chosen": rng.choice(_SAFETY_CHOSEN),
                     "rejected": rng.choice(_SAFETY_REJECTED).format(request)})
    return rows


def make_countdown_rows(
    num_rows: int,
    *,
    seed: int = 0,
    num_numbers: int = 4,
    max_number: int = 50,
    max_target: int = 1000,
    use_all_numbers: bool = False,
) -> list[dict[str, Any]]:
    """Countdown: reach "target" with + - * / over "numbers", each used at most once (exactly once when
    use_all_numbers). Every row is solvable: the target comes from a random expression over the numbers, which
    is kept in "answer" as a reference solution. Check responses with `mcore_rl.rewards.countdown_reward`.
    """
    if num_numbers < 2:
        raise ValueError(f"num_numbers ({num_numbers}) must be at least 2")
    if max_number < 1 or max_target < 1:
        raise ValueError(f"max_number ({max_number}) and max_target ({max_target}) must be positive")
    rng = random.Random(seed)
    rule = "exactly once" if use_all_numbers else "at most once"
    rows = []
    while len(rows) < num_rows:
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        used = rng.sample(numbers, num_numbers if use_all_numbers else rng.randint(2, num_numbers))
        solution, target = _random_expression(rng, used)
        if not 1 <= target <= max_target:
            continue
        prompt = (
            f"Using the numbers {numbers}, create an equation that equals {target}. You can use + - * / and "
            f"parentheses, and each number {rule}. Show your work, then give the equation alone in "
            "<answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
        )
        rows.append({"prompt": prompt, "answer": solution, "numbers": numbers, "target": target})
    return rows


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def _check_problem_args(min_digits: int, max_digits: int, operators: str) -> None:
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits ({min_digits}) <= max_digits ({max_digits})")
    if not operators or set(operators) - set("+-*"):
        raise ValueError(f"operators ({operators!r}) must be a non-empty string of '+', '-', '*'")


def _random_problem(rng: random.Random, num_operands: int, min_digits: int, max_digits: int,
                    operators: str) -> tuple[str, int]:
    """An expression like "23 + 48 * 7" and its value (the usual precedence): operands first, then operators."""
    operands = [_random_operand(rng, min_digits, max_digits) for _ in range(num_operands)]
    ops = [rng.choice(operators) for _ in range(num_operands - 1)]
    expr = " ".join([str(operands[0])] + [f"{op} {b}" for op, b in zip(ops, operands[1:], strict=True)])
    return expr, _evaluate(operands, ops)


def _random_operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _evaluate(operands: list[int], ops: list[str]) -> int:
    """+, - and * with * binding tighter."""
    total, term, sign = 0, operands[0], 1
    for op, b in zip(ops, operands[1:], strict=True):
        if op == "*":
            term *= b
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), b
    return total + sign * term


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, int]:
    """Fold the numbers left to right with random operators, keeping every intermediate a positive integer."""
    expr, value = str(numbers[0]), numbers[0]
    for b in numbers[1:]:
        ops = ["+", "*"] + (["-"] if value > b else []) + (["/"] if value % b == 0 else [])
        op = rng.choice(ops)
        if op in "*/" and not expr.isdigit():
            expr = f"({expr})"
        expr = f"{expr} {op} {b}"
        value = {"+": value + b, "-": value - b, "*": value * b, "/": value // b}[op]
    return expr, value
