import logging
import math
import subprocess
import sys
import textwrap
import threading

import pytest

from mcore_rl.config.reward import RewardConfig
from mcore_rl.rewards import RewardFn, RewardManager
from mcore_rl.rewards.manager import RewardError
from mcore_rl.types import Sample

LOGGER = "mcore_rl.rewards.manager"


def make_samples(responses, **meta):
    return [Sample([1], [2], [0.0], "stop", prompt_text="p", response_text=r, meta=dict(meta)) for r in responses]


def per_sample(fn):
    return RewardFn(lambda chunk: [fn(s) for s in chunk], chunk_size=1)


@pytest.fixture
def release():
    """Set at teardown so that threads blocked in a 'hung' reward function finish."""
    event = threading.Event()
    yield event
    event.set()


def test_math_reward_from_config_with_scale_and_clip():
    batch = make_samples(["#### 7", "\\boxed{7}", "#### 8", "no idea"], answer="7")
    cfg = RewardConfig(name="math", format_score=0.5, incorrect_score=-1.0, scale=2.0, clip_min=-1.5)
    with RewardManager(cfg) as manager:
        metrics = manager.score(batch)
    assert [s.reward for s in batch] == [2.0, 2.0, 1.0, -1.5]
    assert metrics == {
        "reward/mean": (2.0 + 2.0 + 1.0 - 1.5) / 4,
        "reward/min": -1.5,
        "reward/max": 2.0,
        "reward/num_errors": 0.0,
        "reward/num_timeouts": 0.0,
    }


def test_gsm8k_boxed_exact_match_and_countdown_from_config():
    def score(cfg, batch):
        with RewardManager(cfg) as manager:
            manager.score(batch)
        return [s.reward for s in batch]

    assert score(RewardConfig(name="gsm8k"), make_samples(["#### 7", "\\boxed{7}"], answer="7")) == [1.0, 0.0]
    assert score(RewardConfig(name="boxed"), make_samples(["#### 7", "\\boxed{7}"], answer="7")) == [0.0, 1.0]
    text = make_samples(["<answer>Paris</answer>", "Rome"], answer="paris")
    assert score(RewardConfig(name="exact_match"), text) == [1.0, 0.0]
    responses = ["<answer>(25 - 5) * 3</answer>", "<answer>25 + 5</answer>"]
    countdown = make_samples(responses, numbers=[25, 5, 3], target=60)
    assert score(RewardConfig(name="countdown", format_score=0.1), countdown) == [1.0, 0.1]


def test_raising_reward_function_gets_fallback_is_counted_and_first_tracebacks_logged(caplog):
    def flaky(sample):
        if sample.response_text.startswith("bad"):
            raise ZeroDivisionError(f"cannot score {sample.response_text}")
        return 1.0

    cfg = RewardConfig(name="math", fallback_reward=-0.5, max_logged_errors=2, num_workers=2, max_error_fraction=1.0)
    manager = RewardManager(cfg, reward_fn=per_sample(flaky))
    batch = make_samples(["ok", "bad1", "ok", "bad2", "bad3"])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        metrics = manager.score(batch)
        manager.score(make_samples(["bad4"]))
    manager.close()
    assert [s.reward for s in batch] == [1.0, -0.5, 1.0, -0.5, -0.5]
    assert metrics["reward/num_errors"] == 3.0 and metrics["reward/mean"] == pytest.approx(0.5 / 5)
    assert (manager.num_errors_total, manager.num_timeouts_total) == (4, 0)
    tracebacks = [r.message for r in caplog.records if "Traceback" in r.message]
    assert len(tracebacks) == 2  # max_logged_errors, although four calls failed
    assert "samples 1..1" in tracebacks[0] and "ZeroDivisionError: cannot score bad1" in tracebacks[0]
    summaries = [r.message for r in caplog.records if "samples failed" in r.message]
    assert summaries == [
        "reward 'math': 3 of 5 samples failed (3 errors, 0 timeouts) and got the fallback reward -0.5",
        "reward 'math': 1 of 1 samples failed (1 errors, 0 timeouts) and got the fallback reward -0.5",
    ]


def test_hanging_reward_function_times_out_and_the_run_goes_on(release):
    def sometimes_hangs(sample):
        if sample.response_text == "hang":
            release.wait(timeout=60)
        return float(len(sample.response_text))

    cfg = RewardConfig(name="math", timeout_s=0.5, num_workers=2, fallback_reward=-1.0)
    manager = RewardManager(cfg, reward_fn=per_sample(sometimes_hangs))
    batch = make_samples(["a", "hang", "bb", "hang", "hang", "ccc"])
    metrics = manager.score(batch)
    assert [s.reward for s in batch] == [1.0, -1.0, 2.0, -1.0, -1.0, 3.0]
    assert metrics["reward/num_timeouts"] == 3.0 and metrics["reward/num_errors"] == 0.0
    # All workers once hung; replacements keep the pool at full strength for the next step.
    again = make_samples(["dddd", "ee"])
    assert manager.score(again)["reward/num_timeouts"] == 0.0
    assert [s.reward for s in again] == [4.0, 2.0]
    assert manager.num_timeouts_total == 3
    manager.close()


@pytest.mark.parametrize("bad_value", ["1.0", None, math.nan, math.inf, True, [1.0]])
def test_non_numeric_returns_are_errors(bad_value, caplog):
    manager = RewardManager(RewardConfig(name="math", num_workers=1, max_error_fraction=1.0),
                            reward_fn=per_sample(lambda s: bad_value))
    batch = make_samples(["x"])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert manager.score(batch)["reward/num_errors"] == 1.0
    assert batch[0].reward == 0.0
    assert f"returned {bad_value!r}; expected a finite float" in caplog.text
    manager.close()


def test_batch_function_returning_the_wrong_count_fails_its_chunk():
    fn = RewardFn(lambda chunk: [1.0] * (len(chunk) - 1 if len(chunk) == 2 else len(chunk)), chunk_size=2)
    manager = RewardManager(RewardConfig(name="math", num_workers=1, max_error_fraction=1.0), reward_fn=fn)
    batch = make_samples(["a", "b", "c"])
    assert manager.score(batch)["reward/num_errors"] == 2.0
    assert [s.reward for s in batch] == [0.0, 0.0, 1.0]
    manager.close()


def test_inline_mode_also_contains_errors():
    cfg = RewardConfig(name="math", num_workers=0, timeout_s=None)
    manager = RewardManager(cfg, reward_fn=per_sample(lambda s: 1 / 0 if s.response_text == "x" else 2))
    batch = make_samples(["x", "y"])
    assert manager.score(batch)["reward/num_errors"] == 1.0
    assert [s.reward for s in batch] == [0.0, 2.0]


def test_missing_meta_key_is_reported(caplog):
    batch = make_samples(["#### 7"])  # no meta["answer"]
    cfg = RewardConfig(name="math", max_error_fraction=1.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER), RewardManager(cfg) as manager:
        assert manager.score(batch)["reward/num_errors"] == 1.0
    assert "sample.meta has no 'answer' (it has []); carry that column with data.meta_keys" in caplog.text


def test_user_function_by_path(tmp_path):
    module = tmp_path / "user_reward.py"
    module.write_text(
        "def score(prompt_text, response_text, meta):\n"
        "    if response_text == 'boom':\n"
        "        raise RuntimeError('user code failed')\n"
        "    return float(response_text == meta['answer'])\n"
    )
    cfg = RewardConfig(name="function", function_path=f"{module}:score")
    batch = make_samples(["7", "8", "boom"], answer="7")
    with RewardManager(cfg) as manager:
        metrics = manager.score(batch)
    assert [s.reward for s in batch] == [1.0, 0.0, 0.0]
    assert metrics["reward/num_errors"] == 1.0
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        RewardManager(RewardConfig(name="function", function_path=f"{module}:nope"))


def test_a_reward_function_that_never_returns_does_not_block_interpreter_exit(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        textwrap.dedent(
            """
            import threading
            from mcore_rl.config.reward import RewardConfig
            from mcore_rl.rewards import RewardFn, RewardManager
            from mcore_rl.types import Sample

            never = threading.Event()
            fn = RewardFn(lambda chunk: [never.wait() and 1.0], chunk_size=1)
            manager = RewardManager(RewardConfig(name="math", timeout_s=0.1, num_workers=1, max_error_fraction=1.0),
                                    reward_fn=fn)
            print(manager.score([Sample([1], [2], [0.0], "stop")]))
            """
        )
    )
    # concurrent.futures would join the hung thread at exit and never return; the daemon workers do not.
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "'reward/num_timeouts': 1.0" in done.stdout


@pytest.mark.parametrize("returns, first", [(None, "ZeroDivisionError: division by zero"),
                                            (math.nan, "returned nan; expected a finite float")])
def test_a_step_failing_beyond_max_error_fraction_stops_the_run(returns, first):
    """3 of 4 samples fail (0.75 > the default 0.5): RewardError, naming the reward, the counts, the first
    failure and the switch; at 0.75 exactly the step is scored with the fallback."""
    def fn(sample):
        if sample.response_text == "ok":
            return 1.0
        return 1 / 0 if returns is None else returns

    batch = make_samples(["ok", "x", "y", "z"])
    with RewardManager(RewardConfig(name="math", num_workers=1), reward_fn=per_sample(fn)) as manager:
        with pytest.raises(RewardError) as e:
            manager.score(batch)
    assert str(e.value) == (
        f"reward 'math' failed on 3 of the step's 4 samples (3 errors, 0 timeouts), more than "
        f"reward.max_error_fraction (0.5) allows. The first failure: {first}. Fix the reward, or set "
        "reward.max_error_fraction=1.0 to train on reward.fallback_reward for the samples it cannot score")
    cfg = RewardConfig(name="math", num_workers=1, max_error_fraction=0.75)
    with RewardManager(cfg, reward_fn=per_sample(fn)) as manager:
        assert manager.score(batch)["reward/num_errors"] == 3.0


def test_max_error_fraction_is_checked():
    with pytest.raises(ValueError, match=r"max_error_fraction \(1.5\) must be in \[0, 1\]"):
        RewardConfig(name="math", max_error_fraction=1.5)
