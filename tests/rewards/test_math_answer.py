from fractions import Fraction

import pytest

from mcore_rl.rewards import Grade, Scores, answers_match, extract_boxed, extract_gsm8k_answer, grade_math, math_reward
from mcore_rl.rewards.math_answer import extract_last_number, parse_number, reference_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("So she has 72 apples.\n#### 72", "72"),
        ("#### 1,234", "1,234"),
        ("#### $18.00", "$18.00"),
        ("first #### 3\nthen #### 5", "5"),
        ("#### The answer is 42 apples", "42"),
        ("####  -7.5\nmore text", "-7.5"),
        ("#### \\frac{1}{2}", "\\frac{1}{2}"),
        ("#### x = y", "x = y"),
        ("no marker 72", None),
        ("####   \n", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\sqrt{\\frac{a}{b}}} and more", "\\sqrt{\\frac{a}{b}}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("$\\boxed 7$", "7"),
        ("\\fbox{x+1}", "x+1"),
        ("\\boxed{ 3 }", "3"),
        ("\\boxed{unclosed {brace}", None),
        ("\\boxed{}", None),
        ("no box here", None),
        ("\\boxedfoo", None),
    ],
)
def test_extract_boxed_handles_nested_braces(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, value",
    [
        ("72", Fraction(72)),
        ("72.", Fraction(72)),
        ("72.0", Fraction(72)),
        ("-3", Fraction(-3)),
        ("\u22123", Fraction(-3)),  # Unicode minus
        ("+3", Fraction(3)),
        ("1,234,567", Fraction(1234567)),
        ("1,234.50", Fraction(123450, 100)),
        ("1 234", Fraction(1234)),
        ("$5", Fraction(5)),
        ("\\$5", Fraction(5)),
        ("50%", Fraction(50)),
        ("50\\%", Fraction(50)),
        ("0.5", Fraction(1, 2)),
        (".5", Fraction(1, 2)),
        ("1/2", Fraction(1, 2)),
        ("-3/4", Fraction(-3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{3}{4}", Fraction(3, 4)),
        ("-\\frac{3}{4}", Fraction(-3, 4)),
        ("\\frac{-3}{4}", Fraction(-3, 4)),
        ("\\frac34", Fraction(3, 4)),
        ("1{,}000", Fraction(1000)),
        ("1e3", Fraction(1000)),
        ("1/0", None),
        ("1,23", None),
        ("12,34,567", None),
        ("(1, 2)", None),
        ("x", None),
        ("3 apples", None),
        ("", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "predicted, reference, match",
    [
        ("1,000", "1000", True),
        ("1000.0", "1000", True),
        ("\\frac{1}{2}", "0.5", True),
        ("1/2", "\\dfrac{1}{2}", True),
        ("0.333", "1/3", False),
        ("-5", "5", False),
        ("\\pi/2", "\\frac{\\pi}{2}", False),
        ("\\text{(A)}", "(A)", True),
        ("x + 1", "x+1", True),
    ],
)
def test_answers_match(predicted, reference, match):
    assert answers_match(predicted, reference) is match


def test_relative_tolerance():
    assert answers_match("0.333", "1/3", rel_tol=0.01)
    assert not answers_match("0.3", "1/3", rel_tol=0.01)


def test_reference_answer_reads_full_gsm8k_solutions():
    assert reference_answer("She has 3 + 4 = <<3+4=7>>7.\n#### 7") == "7"
    assert reference_answer("\\boxed{12}") == "12"
    assert reference_answer(" 18 ") == "18"


@pytest.mark.parametrize(
    "response, extract, grade",
    [
        ("3 + 4 = 7\n#### 7", "auto", Grade.CORRECT),
        ("so \\boxed{7}", "auto", Grade.CORRECT),
        ("so \\boxed{8}", "auto", Grade.WRONG),
        ("The answer is 7", "auto", Grade.NO_ANSWER),
        ("\\boxed{7}", "gsm8k", Grade.NO_ANSWER),
        ("#### 7", "boxed", Grade.NO_ANSWER),
        ("#### 7.00", "gsm8k", Grade.CORRECT),
    ],
)
def test_grade_math(response, extract, grade):
    assert grade_math(response, "7", extract=extract) is grade


def test_last_number_fallback():
    assert grade_math("I think it is 7.", "7") is Grade.NO_ANSWER
    assert grade_math("I think it is 7.", "7", fallback_last_number=True) is Grade.CORRECT
    assert grade_math("it is 6, no 8", "7", fallback_last_number=True) is Grade.WRONG
    assert extract_last_number("totals 1,200 and -3.5") == "-3.5"


def test_math_reward_uses_configured_scores():
    scores = Scores(correct=2.0, format=0.1, incorrect=-1.0)
    assert math_reward("#### 7", "7", scores=scores) == 2.0
    assert math_reward("#### 6", "7", scores=scores) == 0.1
    assert math_reward("seven", "7", scores=scores) == -1.0
    with pytest.raises(ValueError, match="extract \\('latex'\\) must be one of"):
        math_reward("#### 7", "7", extract="latex")
