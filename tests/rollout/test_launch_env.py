import os

from mcore_rl.rollout.launch_env import without_torchrun_env


def test_torchrun_variables_hidden_then_restored(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with without_torchrun_env():
        assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
        assert "WORLD_SIZE" not in os.environ and "MASTER_PORT" not in os.environ
        assert os.environ["OMP_NUM_THREADS"] == "1"  # everything else stays
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert os.environ["WORLD_SIZE"] == "2" and os.environ["MASTER_PORT"] == "29500"
