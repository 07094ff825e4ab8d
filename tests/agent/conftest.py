import pytest


@pytest.fixture(scope="session")
def trained_agent_model(tmp_path_factory):
    """(path, final training loss) of tiny_agent.py's tool-calling model, trained once for every module that needs
    it (about 100 s on the CPU machines); the tests only read it."""
    from tests.agent.tiny_agent import make_agent_model

    return make_agent_model(tmp_path_factory.mktemp("agent") / "model", steps=300)
