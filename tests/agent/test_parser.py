"""Tool-call parsing (mcore_rl/agent/parser.py): well-formed calls, every malformed kind with its message, markers."""

import pytest

from mcore_rl.agent.parser import ToolCallFormat, end_of_call, parse_tool_calls

TOOLS = {"calculator", "python"}


def test_no_marker_is_an_answer():
    assert parse_tool_calls("The answer is 4.", TOOLS) == []


def test_one_call_and_several_in_order():
    text = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    (call,) = parse_tool_calls(text, TOOLS)
    assert call.ok and call.name == "calculator" and call.arguments == {"expression": "2+2"}
    two = text + ' then <tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    assert [c.name for c in parse_tool_calls(two, TOOLS)] == ["calculator", "python"]


def test_arguments_default_and_as_json_string():
    (a,) = parse_tool_calls('<tool_call>{"name": "python"}</tool_call>', TOOLS)
    assert a.ok and a.arguments == {}
    (b,) = parse_tool_calls('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}</tool_call>', TOOLS)
    assert b.ok and b.arguments == {"code": "1"}


@pytest.mark.parametrize("body, message", [
    ('{"name": "calculator", "arguments": {', "tool call is not valid JSON"),
    ('["calculator"]', "tool call must be a JSON object, got list"),
    ('{"arguments": {}}', 'tool call has no "name"'),
    ('{"name": 3}', 'tool call has no "name"'),
    ('{"name": "search", "arguments": {}}', "unknown tool 'search'; available tools: calculator, python"),
    ('{"name": "calculator", "arguments": [1, 2]}', '"arguments" of calculator must be a JSON object, got list'),
    ('{"name": "calculator", "arguments": "2+2"}', '"arguments" of calculator must be a JSON object, got str'),
])
def test_malformed_calls_carry_a_message(body, message):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>", TOOLS)
    assert not call.ok and call.error.startswith(message), call.error
    assert call.raw == body


def test_unclosed_call_is_malformed():
    (call,) = parse_tool_calls('x <tool_call>{"name": "calculator"', TOOLS)
    assert call.error == "tool call has no closing </tool_call>"
    assert end_of_call('x <tool_call>{"name": "calculator"') == -1


def test_end_of_call_is_after_the_first_closed_call():
    text = 'a<tool_call>{}</tool_call>b<tool_call>{}</tool_call>'
    assert text[:end_of_call(text)] == "a<tool_call>{}</tool_call>"
    assert end_of_call("</tool_call> stray end, no call") == -1


def test_custom_markers():
    fmt = ToolCallFormat("[CALL]", "[/CALL]")
    (call,) = parse_tool_calls('[CALL]{"name": "python", "arguments": {"code": "1"}}[/CALL]', TOOLS, fmt)
    assert call.ok and call.name == "python"
    assert parse_tool_calls('<tool_call>{"name": "python"}</tool_call>', TOOLS, fmt) == []
    with pytest.raises(ValueError, match="must differ"):
        ToolCallFormat("|", "|")
