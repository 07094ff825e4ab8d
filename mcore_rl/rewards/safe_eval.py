"""Evaluate arithmetic written by a model, without `eval`.

The text is parsed with `ast.parse(mode="eval")` and walked by hand. Only integer and decimal literals, + - * /,
unary minus/plus and parentheses are accepted; names, calls, attributes, subscripts, `**`, strings, lambdas and
everything else raise `UnsafeExpression`, so `__import__('os').system(...)` or `().__class__` never run. The
value is an exact `Fraction` (so (1/3)*3 == 1), the length is bounded, and division by zero raises
`ZeroDivisionError`.
"""

from __future__ import annotations

import ast
import math
from fractions import Fraction

# Bounds the size of the numbers (at most ~10**500) and the nesting depth of the tree, and so the recursion below.
MAX_EXPRESSION_CHARS = 500

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
_UNARY = {ast.USub: lambda a: -a, ast.UAdd: lambda a: a}
_ALLOWED_NODES = frozenset({ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, *_BINARY, *_UNARY})


class UnsafeExpression(ValueError):
    """The text is not plain arithmetic (or is too long / too deeply nested to evaluate)."""


def safe_eval_arithmetic(expression: str, *, allow_unary: bool = True) -> Fraction:
    """Exact value of `expression`, an arithmetic expression over numeric literals.

    allow_unary=False also refuses unary minus/plus (countdown rules build numbers only from the given ones).
    """
    return _eval(parse_arithmetic(expression, allow_unary=allow_unary).body)


def literal_numbers(expression: str) -> list[Fraction]:
    """The numeric literals of an arithmetic expression, in source order (nothing is evaluated)."""
    nodes = [n for n in ast.walk(parse_arithmetic(expression)) if isinstance(n, ast.Constant)]
    nodes.sort(key=lambda n: (n.lineno, n.col_offset))
    return [Fraction(str(n.value)) for n in nodes]


def parse_arithmetic(expression: str, *, allow_unary: bool = True) -> ast.Expression:
    """The syntax tree of `expression`, after checking that every node in it is plain arithmetic."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise UnsafeExpression(f"expression is {len(expression)} characters; the limit is {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:  # ValueError: null bytes
        raise UnsafeExpression(f"not a valid expression: {type(e).__name__}: {e}") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.UnaryOp) and not allow_unary:
            raise UnsafeExpression("unary minus/plus is not allowed here")
        if type(node) not in _ALLOWED_NODES:
            raise UnsafeExpression(f"{type(node).__name__} is not allowed; only numbers, + - * / and parentheses")
        if isinstance(node, ast.Constant):
            # bool is an int subclass; True/False are names in the source, not arithmetic
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise UnsafeExpression(f"only numbers are allowed, got {node.value!r:.40}")
            if isinstance(node.value, float) and not math.isfinite(node.value):
                raise UnsafeExpression(f"number out of range: {node.value}")
    return tree


def _eval(node: ast.AST) -> Fraction:
    """Evaluate a tree that parse_arithmetic has checked."""
    if isinstance(node, ast.Constant):
        return Fraction(str(node.value))  # str(): 0.1 -> 1/10, not the binary float
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError("division by zero")
        return _BINARY[type(node.op)](left, right)
    assert isinstance(node, ast.UnaryOp), f"parse_arithmetic let {type(node).__name__} through"
    return _UNARY[type(node.op)](_eval(node.operand))
