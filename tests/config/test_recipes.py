"""Every named recipe in conf/experiment composes into a valid RLConfig (its checks run), and the Qwen3-30B-A3B
recipes' layouts fit the model and the world they are written for: the published config of Qwen3-30B-A3B (shapes
only, no weights) through the same checks a run does before it starts (parallel.validate, the builder's
TransformerConfig with its MoE fields)."""

from pathlib import Path

import pytest

from tests.config.test_root import compose

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))

# Qwen3-30B-A3B's config.json, the fields the builder reads.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_bias": False, "router_aux_loss_coef": 0.001,
}


def recipe(name: str):
    return compose(f"experiment={name}", "model.path=/ckpt/model", "data.train_files=[/data/train.jsonl]")


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes(name):
    cfg = recipe(name)
    assert cfg.trainer.total_steps > 0


@pytest.mark.parametrize("name, world, layers_per_stage", [("qwen3_30b_a3b_8gpu", 8, 48),
                                                           ("qwen3_30b_a3b_2node", 16, 24)])
def test_qwen3_30b_a3b_layout_fits(name, world, layers_per_stage):
    from mcore_rl.models.builder import transformer_config
    from mcore_rl.parallel.runtime import validate

    cfg = recipe(name)
    dp = validate(cfg.parallel, world, QWEN3_30B_A3B)
    assert dp == world // cfg.parallel.pp == 8
    tc = transformer_config(QWEN3_30B_A3B, cfg.model, cfg.parallel)
    assert tc.num_moe_experts // tc.expert_model_parallel_size == 16  # experts per GPU in every MoE layer
    assert tc.num_layers // cfg.parallel.pp == layers_per_stage
    assert (tc.moe_router_topk, tc.moe_ffn_hidden_size, tc.moe_router_pre_softmax) == (8, 768, False)
    assert cfg.rollout.tp_size == cfg.rollout.extra_args["ep_size"] == 8


def test_a_layout_that_does_not_fit_is_refused():
    from mcore_rl.parallel.runtime import validate

    cfg = recipe("qwen3_30b_a3b_8gpu")
    message = r"world size \(4\) is not divisible by parallel.etp \(1\) x parallel.ep \(8\)"
    with pytest.raises(ValueError, match=message):
        validate(cfg.parallel, 4, QWEN3_30B_A3B)
