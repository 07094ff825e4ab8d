from fractions import Fraction

import pytest

from mcore_rl.rewards import UnsafeExpression, safe_eval_arithmetic
from mcore_rl.rewards.safe_eval import MAX_EXPRESSION_CHARS, literal_numbers


@pytest.mark.parametrize(
    "expr, value",
    [
        ("1 + 2 * 3", Fraction(7)),
        ("(1 + 2) * 3", Fraction(9)),
        ("(1/3) * 3", Fraction(1)),  # exact, where floats give 1.0 only by luck
        ("0.1 + 0.2", Fraction(3, 10)),  # exact, where floats give 0.30000000000000004
        ("7 / 2", Fraction(7, 2)),
        ("-(3 - 5)", Fraction(2)),
        ("+4", Fraction(4)),
        (" 10 - 2 - 3 ", Fraction(5)),
        ("1+" * 240 + "1", Fraction(241)),  # long but flat
    ],
)
def test_values_are_exact(expr, value):
    assert safe_eval_arithmetic(expr) == value


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('echo pwned')",
        "().__class__.__bases__[0].__subclasses__()",
        "open('/etc/passwd').read()",
        "exec('1')",
        "(lambda: 1)()",
        "x + 1",
        "2 ** 3",
        "9 ** 9 ** 9",
        "'a' * 3",
        "[1, 2]",
        "1 if True else 2",
        "True + 1",
        "1 // 2",
        "5 % 3",
        "1 < 2",
        "f'{1}'",
        "1e999",
        "1; 2",
        "import os",
        "1 +",
        "",
        "1\x00",
    ],
)
def test_anything_but_arithmetic_is_refused(expr):
    with pytest.raises(UnsafeExpression):
        safe_eval_arithmetic(expr)


def test_refusal_names_the_construct():
    with pytest.raises(UnsafeExpression, match="Call is not allowed; only numbers, \\+ - \\* / and parentheses"):
        safe_eval_arithmetic("__import__('os')")
    with pytest.raises(UnsafeExpression, match="Attribute is not allowed"):
        safe_eval_arithmetic("(1).real")


def test_limits():
    with pytest.raises(UnsafeExpression, match=f"the limit is {MAX_EXPRESSION_CHARS}"):
        safe_eval_arithmetic("1" * (MAX_EXPRESSION_CHARS + 1))
    with pytest.raises(UnsafeExpression, match="not a valid expression"):
        safe_eval_arithmetic("(" * 240 + "1" + ")" * 240)  # deeper than the parser allows
    with pytest.raises(ZeroDivisionError):
        safe_eval_arithmetic("1 / (2 - 2)")
    with pytest.raises(UnsafeExpression, match="unary minus/plus is not allowed"):
        safe_eval_arithmetic("-3 + 5", allow_unary=False)


def test_literal_numbers_in_source_order():
    assert literal_numbers("(25 - 5) * 3 / 2.5") == [25, 5, 3, Fraction(5, 2)]
    with pytest.raises(UnsafeExpression):
        literal_numbers("abs(-3)")
