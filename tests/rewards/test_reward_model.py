"""The HF sequence-classification scorer on a tiny random Llama reward model built in the test."""

import pytest
import torch
import transformers

from mcore_rl.config.reward import RewardConfig, RewardModelConfig
from mcore_rl.rewards import RewardManager
from mcore_rl.rewards.reward_model import RewardModelScorer
from mcore_rl.testing import make_tiny_tokenizer
from mcore_rl.types import Sample


def build_rm(path, num_labels=1):
    tok = make_tiny_tokenizer(path)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_labels=num_labels, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(cfg)
    with torch.no_grad():  # HF's init leaves the score head near zero; spread the outputs apart
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    return build_rm(tmp_path_factory.mktemp("rm"))


def sample(prompt, response, messages=None):
    meta = {} if messages is None else {"messages": messages}
    return Sample([1], [2], [0.0], "stop", prompt_text=prompt, response_text=response, meta=meta)


def direct_score(path, text):
    """Reference: the model run by hand on one unpadded sequence; the logit at its last token."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()


def test_batched_scores_match_one_at_a_time_and_a_direct_forward(rm_path):
    batch = [
        sample("<|user|>What is 1 + 1?<|end|><|assistant|>", "#### 2"),
        sample("<|user|>hi<|end|><|assistant|>", "a much longer response with many more tokens in it"),
        sample("<|user|>x<|end|><|assistant|>", "3"),
    ]
    scorer = RewardModelScorer(str(rm_path), batch_size=3, use_chat_template=False)
    batched = scorer(batch)
    one_by_one = [RewardModelScorer(str(rm_path), batch_size=1, use_chat_template=False)([s])[0] for s in batch]
    direct = [direct_score(rm_path, s.prompt_text + s.response_text) for s in batch]
    # fp32, right padding with an attention mask: the last real token's logit only differs by summation order.
    assert batched == pytest.approx(one_by_one, abs=1e-5)
    assert batched == pytest.approx(direct, abs=1e-5)
    assert max(batched) - min(batched) > 1e-3  # the scores are not all the same number


def test_chat_template_of_the_reward_model_is_used_with_messages(rm_path):
    scorer = RewardModelScorer(str(rm_path))
    s = sample("ignored when messages are given", "#### 2", messages=[{"role": "user", "content": "What is 1 + 1?"}])
    assert scorer.text(s) == "<|user|>What is 1 + 1?<|end|><|assistant|>#### 2<|end|>"
    assert scorer([s])[0] == pytest.approx(direct_score(rm_path, scorer.text(s)), abs=1e-5)
    assert scorer.text(sample("P:", "R")) == "P:R"  # no messages: prompt_text + response_text


def test_num_labels_must_be_one(tmp_path):
    path = build_rm(tmp_path / "rm3", num_labels=3)
    with pytest.raises(ValueError, match="has num_labels=3; a reward model gives one scalar, so it needs num_labels=1"):
        RewardModelScorer(str(path))


def test_reward_manager_with_reward_model(rm_path):
    cfg = RewardConfig(name="reward_model", reward_model=RewardModelConfig(path=str(rm_path), batch_size=2), scale=0.5)
    batch = [sample("<|user|>a<|end|><|assistant|>", r) for r in ["x", "yy", "zzz"]]
    reference = RewardModelScorer(str(rm_path))(batch)
    with RewardManager(cfg) as manager:
        metrics = manager.score(batch)
    assert [s.reward for s in batch] == pytest.approx([0.5 * r for r in reference], abs=1e-6)
    assert metrics["reward/num_errors"] == 0.0
