"""The tool interface: the calculator's values and every error kind, and build_tools (shipped names, a user Tool
class by dotted path, every error message). The python tool's sandbox is tested in test_sandbox.py."""

from __future__ import annotations

import time

import pytest

from mcore_rl.agent.tools import (
    Calculator,
    PythonExecutor,
    Tool,
    ToolResult,
    build_tools,
    tool_schemas,
)


class EchoTool(Tool):
    """A user tool, loaded below by its dotted path."""

    name = "echo"
    description = "Repeat the text."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    def __init__(self, prefix: str = ""):
        self.prefix = prefix

    def run(self, arguments: dict) -> ToolResult:
        return ToolResult(self.prefix + str(arguments.get("text", "")))


class NotATool:
    name = "nope"


@pytest.mark.parametrize("expression, expected", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("7 / 2", "3.5"), ("7 // 2", "3"), ("-7 % 3", "2"),
    ("2 ** 10", "1024"), ("-(3 - 5)", "2"), ("2 ** -1", "0.5"), ("sqrt(16) + abs(-2)", "6"),
    ("factorial(5)", "120"), ("max(1, 4, 2)", "4"), ("10 ** 20", "100000000000000000000"),
    (" 0.1 + 0.2 ", "0.30000000000000004"),
])
def test_calculator_values(expression, expected):
    result = Calculator().run({"expression": expression})
    assert result == ToolResult(expected, None, result.seconds)


@pytest.mark.parametrize("arguments, error, message", [
    ({"expression": "1 / 0"}, "exception", "division by zero"),
    ({"expression": "5 % 0"}, "exception", "division by zero"),
    ({"expression": "1 +"}, "exception", "not a valid expression"),
    ({"expression": "__import__('os').system('true')"}, "exception", "Call is not allowed"),
    ({"expression": "__import__('os')"}, "exception", "unknown function '__import__'"),
    ({"expression": "().__class__"}, "exception", "Attribute is not allowed"),
    ({"expression": "x + 1"}, "exception", "unknown name 'x'"),
    ({"expression": "'a' * 3"}, "exception", "only numbers are allowed"),
    ({"expression": "9**9**9"}, "exception", "exponent 387420489 is too large"),
    ({"expression": "7 ** 5000"}, "exception", "more than 1000 digits"),
    ({"expression": "factorial(100000)"}, "exception", "factorial of 100000 is too large"),
    ({"expression": "sqrt(-1)"}, "exception", "ValueError: math domain error"),
    ({"expression": "1" * 2000}, "exception", "the limit is 1000"),
    ({"expression": "(" * 300 + "1" + ")" * 300}, "exception", "too many nested parentheses"),
    ({}, "bad_arguments", 'expected arguments {"expression"'),
    ({"expression": 3}, "bad_arguments", "got {'expression': 3}"),
    ("1 + 1", "bad_arguments", "got '1 + 1'"),
])
def test_calculator_errors(arguments, error, message):
    start = time.monotonic()
    result = Calculator().run(arguments)
    assert time.monotonic() - start < 1.0  # refused before anything large is computed
    assert result.error == error
    assert message in result.output and result.output.startswith("calculator: ")


def test_calculator_schema_for_chat_templates():
    schema = Calculator().schema()
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]


def test_build_shipped_tools():
    tools = build_tools(["calculator", {"name": "python", "timeout_s": 3.0, "memory_mb": 256}])
    assert list(tools) == ["calculator", "python"]
    assert isinstance(tools["calculator"], Calculator)
    python = tools["python"]
    assert isinstance(python, PythonExecutor) and python.timeout_s == 3.0 and python.limits.memory_mb == 256
    assert build_tools([]) == {}


def test_build_user_tool_by_path():
    tools = build_tools([{"path": "tests.agent.test_tools:EchoTool", "prefix": "> "}, "calculator"])
    assert isinstance(tools["echo"], EchoTool)
    assert tools["echo"].run({"text": "hi"}).output == "> hi"


def test_build_user_tool_from_file(tmp_path):
    file = tmp_path / "my_tool.py"
    file.write_text("from mcore_rl.agent.tools import Tool, ToolResult\n"
                    "class Upper(Tool):\n    name = 'upper'\n"
                    "    def run(self, arguments):\n        return ToolResult(arguments['text'].upper())\n")
    tools = build_tools([{"path": f"{file}:Upper"}])
    assert tools["upper"].run({"text": "ab"}).output == "AB"


@pytest.mark.parametrize("specs, message", [
    (["shell"], "unknown tool 'shell'; shipped tools are ['calculator', 'python']"),
    ([{"path": "tests.agent.no_such_module:X"}], "cannot import 'tests.agent.no_such_module': ModuleNotFoundError"),
    ([{"path": "tests.agent.test_tools:Missing"}], "'tests.agent.test_tools' has no attribute 'Missing'"),
    ([{"path": "tests.agent.test_tools:NotATool"}], "is not a subclass of mcore_rl.agent.tools.Tool"),
    ([{"path": "EchoTool"}], "must look like 'package.module:ClassName'"),
    ([{"path": "/no/such/file.py:EchoTool"}], "FileNotFoundError: no such file /no/such/file.py"),
    (["calculator", {"name": "calculator"}], "a tool named 'calculator' is already defined"),
    ([{"name": "calculator", "path": "x:Y"}], "needs exactly one of 'name'"),
    ([{"timeout_s": 3}], "needs exactly one of 'name'"),
    ([3], "must be a tool name or a dict"),
    ([{"name": "calculator", "colour": "red"}], "cannot build Calculator: "),
    ([{"name": "python", "colour": "red"}], "its settings are tmp_root, max_code_bytes, timeout_s"),
    ([{"name": "python", "memory_mb": 0}], "memory_mb (0) must be positive"),
])
def test_build_tools_errors(specs, message):
    with pytest.raises(ValueError) as e:
        build_tools(specs)
    assert "tool spec" in str(e.value) and message in str(e.value)


class Unbuildable(EchoTool):
    """Building it fails (as a tool that connects somewhere would on a rank without access): its schema must
    not need an instance."""
    name = "unbuildable"

    def __init__(self, **kwargs):
        raise RuntimeError("no connection from here")


def test_tool_schemas_come_from_classes_without_building_them():
    schemas = tool_schemas(["calculator", {"path": "tests.agent.test_tools:Unbuildable", "url": "x"}])
    assert [s["function"]["name"] for s in schemas] == ["calculator", "unbuildable"]
    assert schemas[0] == Calculator.schema()
    with pytest.raises(ValueError, match="unknown tool 'shell'"):
        tool_schemas(["shell"])


def test_prompts_rendered_with_tool_schemas(tmp_path):
    """agent.tools_in_prompt: the chat template gets the schemas as `tools=`; templates that use them (Qwen2.5,
    Qwen3, Hermes) describe the tools in the prompt, others render the same text as without."""
    from transformers import AutoTokenizer

    from mcore_rl.config.data import DataConfig
    from mcore_rl.data.prompts import load_prompt_dataset
    from mcore_rl.testing import make_tiny_hf_model

    tok = AutoTokenizer.from_pretrained(make_tiny_hf_model(tmp_path / "m"))
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "What is 6 * 7?", "answer": "42"}\n')
    cfg = DataConfig(train_files=[str(data)])
    schemas = tool_schemas(["calculator"])
    plain = load_prompt_dataset(cfg, tok)[0]
    assert load_prompt_dataset(cfg, tok, tools=schemas)[0].prompt_text == plain.prompt_text  # template ignores
    tok.chat_template = ("{% if tools %}<|system|>tools: {% for t in tools %}{{ t.function.name }}: "
                         "{{ t.function.description }}{% endfor %}<|end|>{% endif %}" + tok.chat_template)
    with_tools = load_prompt_dataset(cfg, tok, tools=schemas)[0]
    assert with_tools.prompt_text.startswith("<|system|>tools: calculator: Evaluate an arithmetic expression")
    assert with_tools.prompt_text.endswith(plain.prompt_text)
    assert len(with_tools.prompt_ids) > len(plain.prompt_ids)
