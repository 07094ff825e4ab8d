import json
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.data.synthetic import make_arithmetic_rows, make_countdown_rows, make_preference_rows, write_jsonl
from mcore_rl.rewards import Grade, grade_countdown, grade_math, safe_eval_arithmetic

REPO = Path(__file__).resolve().parents[2]


def test_arithmetic_rows_are_seeded_and_correct():
    rows = make_arithmetic_rows(200, seed=3, num_operands=3, min_digits=2, max_digits=3, operators="+-*")
    assert rows == make_arithmetic_rows(200, seed=3, num_operands=3, min_digits=2, max_digits=3, operators="+-*")
    assert rows != make_arithmetic_rows(200, seed=4, num_operands=3, min_digits=2, max_digits=3, operators="+-*")
    ops_seen = set()
    for row in rows:
        assert row["prompt"].startswith("What is ") and row["prompt"].endswith("? Give the final answer after ####.")
        expr = row["prompt"][len("What is ") : row["prompt"].index("?")]
        tokens = expr.split()
        operands, ops = tokens[::2], tokens[1::2]
        assert len(operands) == 3 and all(2 <= len(x) <= 3 for x in operands)
        ops_seen |= set(ops)
        # Independent check of the answer (precedence included) with the exact evaluator.
        assert safe_eval_arithmetic(expr) == int(row["answer"])
    assert ops_seen == {"+", "-", "*"}


def test_arithmetic_argument_errors():
    with pytest.raises(ValueError, match="num_operands"):
        make_arithmetic_rows(1, num_operands=1)
    with pytest.raises(ValueError, match="min_digits"):
        make_arithmetic_rows(1, min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="operators"):
        make_arithmetic_rows(1, operators="+/")


def test_preference_pairs_chosen_right_rejected_wrong():
    rows = make_preference_rows(50, seed=1)
    for row, problem in zip(rows, make_arithmetic_rows(50, seed=1), strict=True):
        assert row["prompt"] == problem["prompt"]
        assert grade_math(row["chosen"], problem["answer"]) is Grade.CORRECT
        assert grade_math(row["rejected"], problem["answer"]) is Grade.WRONG


@pytest.mark.parametrize("use_all", [False, True])
def test_countdown_rows_are_solvable_by_their_reference(use_all):
    rows = make_countdown_rows(100, seed=2, num_numbers=4, use_all_numbers=use_all)
    for row in rows:
        assert len(row["numbers"]) == 4 and 1 <= row["target"] <= 1000
        response = f"<answer>{row['answer']}</answer>"
        grade = grade_countdown(response, row["numbers"], row["target"], require_all_numbers=use_all)
        assert grade is Grade.CORRECT, row
        assert ("exactly once" if use_all else "at most once") in row["prompt"]


def test_example_script_writes_jsonl(tmp_path):
    out = tmp_path / "cd.jsonl"
    subprocess.run(
        [sys.executable, str(REPO / "examples" / "make_arithmetic_data.py"), "--task", "countdown", "--num", "5",
         "--out", str(out)],
        check=True, capture_output=True, cwd=REPO,
    )  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == make_countdown_rows(5, seed=0)
    assert write_jsonl(rows, tmp_path / "again.jsonl").read_text() == out.read_text()


def test_tool_rows_show_worked_calls_whose_replies_are_the_calculators():
    """The agent recipe's rows: each worked example's call parses, the calculator gives its reply, and the example
    answers with that reply; the question's answer is the product; the shipped file is what the script writes."""
    from mcore_rl.agent.parser import ToolCallFormat, parse_tool_calls
    from mcore_rl.agent.tools import Calculator
    from mcore_rl.data.synthetic import make_tool_arithmetic_rows

    rows = make_tool_arithmetic_rows(50, seed=0, shots=2)
    fmt = ToolCallFormat("<tool_call>", "</tool_call>")
    for row in rows:
        msgs = row["prompt"]
        assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
        for i in (1, 5):
            (call,) = parse_tool_calls(msgs[i + 1]["content"], ["calculator"], fmt)
            assert call.ok and call.arguments["expression"] in msgs[i]["content"]
            reply = Calculator().run(call.arguments).output
            assert msgs[i + 2]["content"] == reply and msgs[i + 3]["content"] == f"#### {reply}"
        a, b = map(int, msgs[-1]["content"].removeprefix("What is ").removesuffix("?").split(" * "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["answer"] == str(a * b)
    assert [m["role"] for m in make_tool_arithmetic_rows(1, shots=0)[0]["prompt"]] == ["system", "user"]
    shipped = (REPO / "examples" / "data" / "tool_arithmetic.jsonl").read_text().splitlines()
    shipped = [json.loads(line) for line in shipped]
    assert shipped == make_tool_arithmetic_rows(512, seed=0, min_digits=2, max_digits=2, operators="*")
