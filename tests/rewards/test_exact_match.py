import pytest

from mcore_rl.rewards import Grade, Scores, exact_match_reward, grade_exact_match
from mcore_rl.rewards.exact_match import extract_text_answer, normalize_text


@pytest.mark.parametrize(
    "response, answer, kwargs, grade",
    [
        ("reasoning...\n<answer>Paris</answer>", "paris", {}, Grade.CORRECT),
        ("reasoning...\nParis", "Paris", {}, Grade.CORRECT),
        ("reasoning...\n  Paris  \n\n", "Paris", {}, Grade.CORRECT),
        ("Paris", "paris", {"ignore_case": False}, Grade.WRONG),
        ("Paris.", "Paris", {}, Grade.WRONG),
        ("Paris.", "Paris", {"ignore_punctuation": True}, Grade.CORRECT),
        ("New   York", "new york", {}, Grade.CORRECT),
        ("Paris\nso London", "Paris", {}, Grade.WRONG),
        ("no tag", "x", {"extract": "answer_tag"}, Grade.NO_ANSWER),
        ("a\nb", "a b", {"extract": "full"}, Grade.CORRECT),
        ("   \n ", "x", {}, Grade.NO_ANSWER),
    ],
)
def test_grade_exact_match(response, answer, kwargs, grade):
    assert grade_exact_match(response, answer, **kwargs) is grade


def test_extract_and_normalise():
    assert extract_text_answer("x\n<answer> y </answer>\nz") == "y"
    assert extract_text_answer("x\n<answer> y </answer>\nz", "last_line") == "z"
    assert normalize_text("  A\tB,  C!  ", ignore_punctuation=True) == "a b c"
    with pytest.raises(ValueError, match="extract \\('first'\\) must be one of"):
        extract_text_answer("x", "first")


def test_exact_match_reward_scores():
    assert exact_match_reward("<answer>B</answer>", "b", scores=Scores(1.0, 0.2, -1.0)) == 1.0
    assert exact_match_reward("<answer>C</answer>", "b", scores=Scores(1.0, 0.2, -1.0)) == 0.2
    assert exact_match_reward("", "b", scores=Scores(1.0, 0.2, -1.0)) == -1.0
