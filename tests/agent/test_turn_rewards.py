"""The shipped per-turn rewards read the error kind from the reply AgentRollout writes for a call
("Error (<kind>): ..."), and the start-time check that an agent task's longest engine request fits the context."""

import pytest

from mcore_rl.agent.turn_rewards import call_format, error_kind, successful_call
from tests.config.test_root import compose


@pytest.mark.parametrize("reply, kind, success, fmt", [
    ("2640", None, 0.2, 0.2),
    ("Error (malformed): unknown tool 'calc'; available tools: calculator", "malformed", 0.0, 0.0),
    ("Error (bad_arguments): calculator: expected arguments {...}", "bad_arguments", 0.0, 0.1),
    ("Error (exception): calculator: division by zero", "exception", 0.0, 0.1),
    ("Error (timeout): tool python timed out after 10 s", "timeout", 0.0, 0.0),
    ("Error (limit)", "limit", 0.0, 0.0),
    ("Errors happen", None, 0.2, 0.2),  # a successful tool's own text, not AgentRollout's error form
])
def test_turn_rewards(reply, kind, success, fmt):
    assert error_kind(reply) == kind
    assert successful_call("<tool_call>...</tool_call>", reply, {}) == success
    assert call_format("<tool_call>...</tool_call>", reply, {}) == fmt


def test_agent_sequence_budget_checked_at_start():
    from mcore_rl.trainer.run import check_sequence_budget

    args = ["model.path=/m", "data.train_files=[/d.jsonl]", "+agent=calculator", "data.max_prompt_length=256",
            "agent.max_response_tokens=1024", "rollout.max_new_tokens=64"]
    check_sequence_budget(compose(*args), {"max_position_embeddings": 256 + 1024 + 64})
    with pytest.raises(ValueError, match=r"data.max_prompt_length \(256\) \+ agent.max_response_tokens \(1024\) \+ "
                       r"rollout.max_new_tokens \(64, the last turn's\) = 1344 tokens do not fit the model's "
                       r"max_position_embeddings \(1343\): lower them"):
        check_sequence_budget(compose(*args), {"max_position_embeddings": 1343})
    with pytest.raises(ValueError, match=r"= 1344 tokens do not fit rollout.context_length \(1024\)"):
        check_sequence_budget(compose(*args, "rollout.context_length=1024"), {"max_position_embeddings": 4096})
    single = ["model.path=/m", "data.train_files=[/d.jsonl]", "data.max_prompt_length=256",
              "rollout.max_new_tokens=64"]
    check_sequence_budget(compose(*single), {"max_position_embeddings": 320})
    with pytest.raises(ValueError, match=r"data.max_prompt_length \(256\) \+ rollout.max_new_tokens \(64\) = 320"):
        check_sequence_budget(compose(*single), {"max_position_embeddings": 319})
    check_sequence_budget(compose(*single, "data.max_prompt_length=null"), {"max_position_embeddings": 8})
