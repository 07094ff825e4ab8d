import sys
import textwrap

import pytest

from mcore_rl.rewards import load_function


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A package `my_rewards` on sys.path with a few functions, good and bad."""
    pkg = tmp_path / "my_rewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(
        textwrap.dedent(
            """
            NOT_CALLABLE = 3

            def length_reward(prompt_text, response_text, meta):
                return len(response_text) / 10

            def too_few(prompt_text):
                return 0.0

            class Scorer:
                @staticmethod
                def score(prompt_text, response_text, meta, scale=2.0):
                    return scale
            """
        )
    )
    (pkg / "broken.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in [m for m in sys.modules if m.startswith("my_rewards")]:
        del sys.modules[name]


def test_loads_colon_and_dotted_paths(user_module):
    for path in ["my_rewards.scoring:length_reward", "my_rewards.scoring.length_reward"]:
        assert load_function(path)("p", "0123456789", {}) == 1.0
    assert load_function("my_rewards.scoring:Scorer.score")("p", "r", {}) == 2.0


def test_loads_from_a_file_path(user_module):
    assert load_function(f"{user_module / 'scoring.py'}:length_reward")("p", "12345", {}) == 0.5


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_such_pkg.mod:fn", "cannot import 'no_such_pkg.mod': ModuleNotFoundError: No module named 'no_such_pkg'"),
        (
            "my_rewards.broken:fn",
            "cannot import 'my_rewards.broken': ModuleNotFoundError: No module named 'not_a_module_anywhere'",
        ),
        ("my_rewards.scoring:missing", "'my_rewards.scoring' has no attribute 'missing'"),
        ("my_rewards.scoring:NOT_CALLABLE", "is not callable (it is a int)"),
        ("my_rewards.scoring:too_few", "must accept (prompt_text, response_text, meta)"),
        ("justaname", "must look like 'package.module:function'"),
        ("/nowhere/file.py:fn", "cannot import '/nowhere/file.py': FileNotFoundError"),
    ],
)
def test_errors_say_what_failed(user_module, path, message):
    with pytest.raises(ValueError) as e:
        load_function(path)
    assert message in str(e.value)
    assert repr(path) in str(e.value)
