"""Tools a model may call during an agentic rollout: the interface, the shipped tools, and loading them by name.

A tool is a `Tool` subclass with a name, a description and a JSON schema of its arguments (what a chat
template's `tools=` list needs), and a `run(arguments) -> ToolResult` that never raises for bad model input and
returns within about `timeout_s`. The rollout (rollout.py) calls tools from a thread pool, so `run` must be
thread-safe. Shipped: `Calculator` ("calculator": arithmetic by walking Python's ast, never eval) and
`PythonExecutor` ("python": the code runs in sandbox.py's limited process). docs/agent_tools.md explains how to
write one and what the sandbox does and does not protect against.
"""

from __future__ import annotations

import ast
import math
import operator
import time
from dataclasses import dataclass
from typing import Any

from mcore_rl.agent.sandbox import SandboxLimits, run_python
from mcore_rl.user_code import load_object

ERROR_KINDS = ("timeout", "exception", "bad_arguments", "limit", "denied", "crashed")


@dataclass
class ToolResult:
    output: str
    """The text the model reads as the tool's reply (already cut to the tool's output limit)."""
    error: str | None = None
    """None on success, else one of ERROR_KINDS."""
    seconds: float = 0.0


class Tool:
    """Base class of every tool, shipped or user-written. Subclasses set the class attributes and override run;
    constructor keyword arguments come from the spec dict given to build_tools."""

    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}}
    timeout_s: float = 10.0

    def run(self, arguments: dict) -> ToolResult:
        raise NotImplementedError(f"tool {self.name!r} ({type(self).__name__}) does not implement run()")

    def close(self) -> None:
        """Release what the tool holds (a connection, a server, an environment); called once when the run ends,
        also after a failure. The shipped tools hold nothing."""

    @classmethod
    def schema(cls) -> dict:
        """The entry of a chat template's `tools=` list (OpenAI function-calling form), from the class
        attributes: prompts are rendered with it on every rank without building the tool."""
        return {"type": "function",
                "function": {"name": cls.name, "description": cls.description, "parameters": cls.parameters}}


def _bad_arguments(tool: Tool, message: str) -> ToolResult:
    return ToolResult(output=f"{tool.name}: {message}", error="bad_arguments")


# --- calculator -------------------------------------------------------------------------------------------------

class CalculatorError(ValueError):
    """What the model wrote cannot be evaluated; the message says why."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil,
              "log": math.log, "log10": math.log10, "exp": math.exp, "sin": math.sin, "cos": math.cos,
              "tan": math.tan, "factorial": math.factorial, "min": min, "max": max}
_CONSTANTS = {"pi": math.pi, "e": math.e}


class Calculator(Tool):
    """Arithmetic on numbers: + - * / // % **, unary minus, parentheses, a few math functions and pi, e.
    Integers are exact; a result beyond max_digits digits, an exponent beyond max_exponent and a factorial beyond
    max_factorial are refused before they are computed, so "9**9**9" answers at once."""

    name = "calculator"
    description = ("Evaluate an arithmetic expression, e.g. '(3 + 4) * 2 ** 10 / 7'. Supports + - * / // % **, "
                   "parentheses, pi, e and sqrt, abs, round, floor, ceil, log, log10, exp, sin, cos, tan, "
                   "factorial, min, max.")
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string", "description": "the arithmetic expression"}},
                  "required": ["expression"]}
    timeout_s = 1.0

    def __init__(self, max_chars: int = 1000, max_digits: int = 1000, max_exponent: int = 10000,
                 max_factorial: int = 1000):
        self.max_chars, self.max_digits = max_chars, max_digits
        self.max_exponent, self.max_factorial = max_exponent, max_factorial

    def run(self, arguments: dict) -> ToolResult:
        start = time.monotonic()
        expression = arguments.get("expression") if isinstance(arguments, dict) else None
        if not isinstance(expression, str):
            return _bad_arguments(self, 'expected arguments {"expression": "<arithmetic>"}, got '
                                  f"{_short(arguments)}")
        try:
            value = self.evaluate(expression)
        except CalculatorError as e:
            return ToolResult(f"calculator: {e}", "exception", time.monotonic() - start)
        except ZeroDivisionError:
            return ToolResult("calculator: division by zero", "exception", time.monotonic() - start)
        except (ValueError, OverflowError, TypeError) as e:  # math domain errors, float overflow, min() of nothing
            return ToolResult(f"calculator: {type(e).__name__}: {e}", "exception", time.monotonic() - start)
        return ToolResult(_format(value), None, time.monotonic() - start)

    def evaluate(self, expression: str) -> int | float:
        if len(expression) > self.max_chars:
            raise CalculatorError(f"the expression has {len(expression)} characters; the limit is {self.max_chars}")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            raise CalculatorError(f"not a valid expression ({type(e).__name__}: {getattr(e, 'msg', e)})") from None
        try:
            return self._eval(tree.body)
        except RecursionError:
            raise CalculatorError("the expression is nested too deeply") from None

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant):
            # bool is an int subclass, and complex numbers are not arithmetic the model means
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise CalculatorError(f"only numbers are allowed, not {node.value!r:.40}")
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in _CONSTANTS:
                raise CalculatorError(f"unknown name {node.id!r}; known constants: {', '.join(_CONSTANTS)}")
            return _CONSTANTS[node.id]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            value = _BINARY[type(node.op)](left, right)
            self._check_size(value)
            return value
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
            fn = _FUNCTIONS.get(node.func.id)
            if fn is None:
                raise CalculatorError(f"unknown function {node.func.id!r}; known: {', '.join(_FUNCTIONS)}")
            args = [self._eval(a) for a in node.args]
            if fn is math.factorial and args and isinstance(args[0], (int, float)) and args[0] > self.max_factorial:
                raise CalculatorError(f"factorial of {_format(args[0])} is too large "
                                      f"(the limit is {self.max_factorial})")
            value = fn(*args)
            self._check_size(value)
            return value
        raise CalculatorError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % **, parentheses "
                              "and the listed functions")

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        if abs(exponent) > self.max_exponent and abs(base) not in (0, 1):
            raise CalculatorError(f"the exponent {_format(exponent)} is too large (the limit is {self.max_exponent})")
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
            # digits of base**exponent, from its logarithm, before computing it
            if exponent * math.log10(abs(base)) > self.max_digits:
                raise CalculatorError(f"the result would have more than {self.max_digits} digits")

    def _check_size(self, value: int | float) -> None:
        if isinstance(value, int) and value.bit_length() > self.max_digits * 3.33:
            raise CalculatorError(f"the result has more than {self.max_digits} digits")


def _format(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# --- python -----------------------------------------------------------------------------------------------------

class PythonExecutor(Tool):
    """Runs the model's Python code in a fresh sandboxed process (sandbox.py) and returns what it printed.

    Keyword arguments are the fields of SandboxLimits (timeout_s, cpu_s, memory_mb, max_output_bytes, ...) and
    tmp_root, the folder the per-call temporary directories go in (default: the system's)."""

    name = "python"
    description = ("Run a Python 3 program and return what it prints (stdout; the end of stderr on errors). Each "
                   "call starts fresh: no state is kept between calls. Only the standard library; no network, "
                   "no subprocesses; files may be written in the current directory only. Print the results you "
                   "need.")
    parameters = {"type": "object",
                  "properties": {"code": {"type": "string", "description": "the Python program to run"}},
                  "required": ["code"]}

    def __init__(self, tmp_root: str | None = None, max_code_bytes: int = 65536, **limits: Any):
        try:
            self.limits = SandboxLimits(**limits)
        except TypeError as e:
            fields = ", ".join(SandboxLimits.__dataclass_fields__)
            raise ValueError(f"python tool: {e}; its settings are tmp_root, max_code_bytes, {fields}") from None
        self.timeout_s = self.limits.timeout_s
        self.tmp_root = tmp_root
        self.max_code_bytes = max_code_bytes

    def run(self, arguments: dict) -> ToolResult:
        code = arguments.get("code") if isinstance(arguments, dict) else None
        if not isinstance(code, str):
            return _bad_arguments(self, f'expected arguments {{"code": "<python program>"}}, got {_short(arguments)}')
        if len(code.encode("utf-8", "replace")) > self.max_code_bytes:
            return _bad_arguments(self, f"the code is longer than {self.max_code_bytes} bytes")
        if "\x00" in code:
            return _bad_arguments(self, "the code contains a NUL character")
        try:
            r = run_python(code, self.limits, self.tmp_root)
        except OSError as e:  # no temp space, no processes left: the trainer's trouble, reported as the tool's
            return ToolResult(f"python: the sandbox could not start: {e}", "crashed")
        output = r.stdout
        if r.error is not None:
            tail = r.stderr if r.error in ("exception", "denied") else ""
            output = "\n".join(part for part in (output.rstrip("\n"), tail.rstrip("\n"), f"[{r.message}]") if part)
        elif r.stderr.strip():
            output = output + ("\n" if output and not output.endswith("\n") else "") + "[stderr]\n" + r.stderr
        return ToolResult(_cut(output, 2 * self.limits.max_output_bytes + 512), r.error, r.seconds)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... cut to {limit} characters]"


# --- loading ----------------------------------------------------------------------------------------------------

SHIPPED_TOOLS: dict[str, type[Tool]] = {"calculator": Calculator, "python": PythonExecutor}


def build_tools(specs) -> dict[str, Tool]:
    """Tools by name from specs: each a shipped name ("calculator", "python"; default settings) or a dict
    {"name": shipped name, **kwargs} or {"path": "package.module:ClassName" (or "path/to/file.py:ClassName"),
    **kwargs} of a user Tool subclass; kwargs go to the class's constructor. ValueError naming the spec for
    unknown names, bad paths, non-Tool classes, bad settings and duplicate names."""
    if isinstance(specs, (str, dict)):
        specs = [specs]
    tools: dict[str, Tool] = {}
    for spec in list(specs or []):
        tool = _build_one(spec)
        if tool.name in tools:
            raise ValueError(f"tool spec {_short(spec)}: a tool named {tool.name!r} is already defined; tool names "
                             "must be unique")
        tools[tool.name] = tool
    return tools


def tool_schemas(specs) -> list[dict]:
    """The chat template's `tools=` list for these specs (Tool.schema of each class; nothing is built, so no
    tool opens a connection or a process on a rank that never calls it)."""
    if isinstance(specs, (str, dict)):
        specs = [specs]
    return [_resolve(spec)[0].schema() for spec in list(specs or [])]


def _resolve(spec) -> tuple[type[Tool], dict]:
    """The class a spec names and its constructor's keyword arguments."""
    if isinstance(spec, str):
        spec = {"name": spec}
    if not hasattr(spec, "keys"):  # dicts and OmegaConf DictConfigs
        raise ValueError(f"tool spec {_short(spec)} must be a tool name or a dict with 'name' or 'path'")
    kwargs = dict(spec)
    name, path = kwargs.pop("name", None), kwargs.pop("path", None)
    if (name is None) == (path is None):
        raise ValueError(f"tool spec {_short(spec)} needs exactly one of 'name' (one of {sorted(SHIPPED_TOOLS)}) "
                         "or 'path' ('package.module:ClassName')")
    if name is not None:
        if name not in SHIPPED_TOOLS:
            raise ValueError(f"tool spec {_short(spec)}: unknown tool {name!r}; shipped tools are "
                             f"{sorted(SHIPPED_TOOLS)}, or give 'path' of your own Tool subclass")
        return SHIPPED_TOOLS[name], kwargs
    return _load_class(str(path), spec), kwargs


def _build_one(spec) -> Tool:
    cls, kwargs = _resolve(spec)
    try:
        tool = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"tool spec {_short(spec)}: cannot build {cls.__name__}: {e}") from e
    if not isinstance(tool.name, str) or not tool.name:
        raise ValueError(f"tool spec {_short(spec)}: {cls.__name__}.name must be a non-empty string")
    if not isinstance(tool.parameters, dict):
        raise ValueError(f"tool spec {_short(spec)}: {cls.__name__}.parameters must be a JSON schema dict")
    return tool


def _load_class(path: str, spec) -> type[Tool]:
    cls = load_object(path, f"tool spec {_short(spec)}",
                      f"tool spec {_short(spec)}: path {path!r} must look like 'package.module:ClassName' or "
                      "'path/to/file.py:ClassName'")
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ValueError(f"tool spec {_short(spec)}: {path!r} is not a subclass of mcore_rl.agent.tools.Tool "
                         f"(it is {_short(cls, 60)})")
    return cls

