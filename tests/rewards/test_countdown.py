import pytest

from mcore_rl.rewards import Grade, Scores, countdown_reward, extract_equation, grade_countdown

NUMBERS = [25, 5, 3, 7]
TARGET = 60  # e.g. (25 - 5) * 3


@pytest.mark.parametrize(
    "response, grade",
    [
        ("<think>try things</think><answer>(25 - 5) * 3</answer>", Grade.CORRECT),
        ("<answer> 3 * (25 - 5) </answer>", Grade.CORRECT),
        ("<answer>(25 - 5) * 3 = 60</answer>", Grade.CORRECT),
        ("<answer>60 = (25 - 5) × 3</answer>", Grade.CORRECT),
        ("<answer>$(25 − 5) \\times 3$</answer>", Grade.CORRECT),
        ("<answer>25 * 7 / 5 * 3 - 25 - 5</answer>", Grade.WRONG),  # 25 and 5 used twice
        ("<answer>(25 + 5) * 3</answer>", Grade.WRONG),  # 90
        ("<answer>253 - 193</answer>", Grade.WRONG),  # numbers that were not given
        ("<answer>(2 - 5) * 3</answer>", Grade.WRONG),
        ("<answer>25 / (5 - 5)</answer>", Grade.WRONG),  # division by zero; 5 also reused
        ("<answer>7 * 3 * 5 / 7 * 3 * 7 / 7 / 3 * 4</answer>", Grade.WRONG),
        ("<answer>60</answer>", Grade.WRONG),  # the target itself is not a given number
        ("first <answer>1 + 1</answer> then <answer>(25 - 5) * 3</answer>", Grade.CORRECT),  # the last tag counts
        ("I tried hard.\n(25 - 5) * 3\n", Grade.CORRECT),  # no tag: the last non-empty line
        ("<answer>twenty</answer>", Grade.NO_ANSWER),
        ("<answer>__import__('os').system('echo pwned')</answer>", Grade.NO_ANSWER),
        ("<answer>-5 + 65</answer>", Grade.NO_ANSWER),  # unary minus is not a countdown move
        ("", Grade.NO_ANSWER),
    ],
)
def test_grade_countdown(response, grade):
    assert grade_countdown(response, NUMBERS, TARGET) is grade


def test_fractions_in_between_are_exact():
    # 8 / (3 - 8/3) = 24: needs exact arithmetic with an intermediate 1/3.
    assert grade_countdown("<answer>8 / (3 - 8 / 3)</answer>", [3, 3, 8, 8], 24) is Grade.CORRECT


def test_repeated_numbers_may_be_used_as_often_as_given():
    assert grade_countdown("<answer>5 * 5 + 5</answer>", [5, 5, 5], 30) is Grade.CORRECT
    assert grade_countdown("<answer>5 * 5 + 5</answer>", [5, 5, 6], 30) is Grade.WRONG


def test_require_all_numbers():
    response = "<answer>(25 - 5) * 3</answer>"
    assert grade_countdown(response, NUMBERS, TARGET, require_all_numbers=True) is Grade.WRONG
    full = "<answer>(25 - 5) * 3 * 7 / 7</answer>"
    assert grade_countdown(full, NUMBERS + [7], TARGET, require_all_numbers=True) is Grade.CORRECT


def test_last_line_fallback_can_be_turned_off():
    assert grade_countdown("(25 - 5) * 3", NUMBERS, TARGET, allow_last_line=False) is Grade.NO_ANSWER


def test_extract_equation():
    assert extract_equation("<answer> 1 + 2 = 3 </answer>") == "1 + 2"
    assert extract_equation("text\n\n  12 * 2.  \n\n") == "12 * 2"
    assert extract_equation("<answer></answer>") is None


def test_countdown_reward_scores():
    scores = Scores(correct=1.0, format=0.1, incorrect=0.0)  # TinyZero's shaping
    assert countdown_reward("<answer>(25 - 5) * 3</answer>", NUMBERS, TARGET, scores=scores) == 1.0
    assert countdown_reward("<answer>25 + 5</answer>", NUMBERS, TARGET, scores=scores) == 0.1
    assert countdown_reward("no idea", NUMBERS, TARGET, scores=scores, allow_last_line=False) == 0.0
