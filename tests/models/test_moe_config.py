"""Mixture-of-experts configs: HF config -> Megatron's MoE fields, the layout checks and every user-facing error."""

import pytest

from mcore_rl.config.model import ModelConfig
from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.models import moe
from mcore_rl.models.arch import resolve_arch
from mcore_rl.models.builder import transformer_config
from mcore_rl.parallel import validate

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "num_experts_per_tok": 2}


def qwen3_moe(**overrides):
    cfg = dict(BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16, num_experts=4,
               moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    cfg.update(overrides)
    return cfg


def mixtral(**overrides):
    cfg = dict(BASE, architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
               router_jitter_noise=0.0)
    cfg.update(overrides)
    return cfg


def test_qwen3_moe_fields():
    cfg = transformer_config(qwen3_moe(), ModelConfig(dtype="fp32", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3),
                             ParallelConfig(ep=2))
    assert (cfg.num_moe_experts, cfg.moe_ffn_hidden_size, cfg.moe_router_topk) == (4, 32, 2)
    assert cfg.qk_layernorm and cfg.moe_router_score_function == "softmax"
    assert not cfg.moe_router_pre_softmax  # norm_topk_prob: softmax over the top-k logits
    assert (cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff) == (0.01, 1e-3)
    assert cfg.moe_token_dispatcher_type == "alltoall" and cfg.variable_seq_lengths
    assert (cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (2, 1)
    assert not cfg.moe_grouped_gemm  # no Transformer Engine here: sequential experts


def test_qwen3_moe_without_norm_topk_prob_keeps_the_full_softmax():
    cfg = transformer_config(qwen3_moe(norm_topk_prob=False), ModelConfig(dtype="fp32"), ParallelConfig())
    assert cfg.moe_router_pre_softmax and cfg.moe_z_loss_coeff is None and cfg.moe_aux_loss_coeff == 0.0


def test_mixtral_fields():
    cfg = transformer_config(mixtral(), ModelConfig(dtype="fp32"), ParallelConfig(etp=1))
    assert (cfg.num_moe_experts, cfg.moe_ffn_hidden_size) == (4, 128)  # Mixtral's experts use intermediate_size
    assert not cfg.moe_router_pre_softmax and not cfg.qk_layernorm


def test_allgather_dispatcher_turns_variable_lengths_off():
    cfg = transformer_config(mixtral(), ModelConfig(moe_token_dispatcher="allgather"), ParallelConfig(ep=2))
    assert cfg.moe_token_dispatcher_type == "allgather" and not cfg.variable_seq_lengths


def test_experts_per_layer_read_from_either_name():
    assert moe.num_experts({"num_experts": 128}) == 128 and moe.num_experts({"num_local_experts": 8}) == 8


@pytest.mark.parametrize("hf, model_cfg, parallel, message", [
    (mixtral(), ModelConfig(), ParallelConfig(ep=3),
     r"the number of experts \(4\) is not divisible by parallel.ep \(3\); every expert-parallel rank holds the "
     r"same number of experts: use a parallel.ep that divides 4"),
    (mixtral(), ModelConfig(moe_token_dispatcher="allgather"), ParallelConfig(pp=2),
     r"model.moe_token_dispatcher=allgather does not work with parallel.pp \(2\) > 1"),
    (mixtral(), ModelConfig(), ParallelConfig(tp=2),
     r"a mixture-of-experts model at parallel.tp \(2\) > 1 needs parallel.sequence_parallel=true"),
    (mixtral(), ModelConfig(moe_grouped_gemm="on"), ParallelConfig(),
     r"model.moe_grouped_gemm=on needs Transformer Engine's TEGroupedMLP"),
    (mixtral(router_jitter_noise=0.01), ModelConfig(), ParallelConfig(),
     r"MixtralForCausalLM with router_jitter_noise=0.01 is not supported"),
    (qwen3_moe(mlp_only_layers=[0]), ModelConfig(), ParallelConfig(),
     r"Qwen3MoeForCausalLM with dense MLP layers \(decoder_sparse_step=1, mlp_only_layers=\[0\]\) is not "
     r"supported"),
    (qwen3_moe(num_experts_per_tok=8), ModelConfig(), ParallelConfig(),
     r"num_experts_per_tok \(8\) is larger than the number of experts \(4\)"),
    (mixtral(), ModelConfig(), ParallelConfig(etp=2),
     r"parallel.etp \(2\) differs from parallel.tp \(1\) at parallel.ep=1, which Megatron-Core does not train "
     r"correctly"),
    (dict(BASE, architectures=["LlamaForCausalLM"]), ModelConfig(), ParallelConfig(ep=2),
     r"parallel.ep \(2\) > 1 needs a mixture-of-experts model; LlamaForCausalLM is dense: set parallel.ep=1"),
])
def test_moe_config_errors(hf, model_cfg, parallel, message):
    with pytest.raises(ValueError, match=message):
        transformer_config(hf, model_cfg, parallel)


def test_unsupported_moe_architecture_names_it_and_the_supported_ones():
    with pytest.raises(ValueError) as e:
        resolve_arch({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"})
    msg = str(e.value)
    assert msg.startswith("Qwen2MoeForCausalLM is a mixture-of-experts architecture this project does not support: "
                          "its shared experts (shared_expert, shared_expert_gate) have no mapping yet; supported "
                          "mixture-of-experts architectures: Qwen3MoeForCausalLM, MixtralForCausalLM")
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM is a mixture-of-experts architecture"):
        resolve_arch({"model_type": "deepseek_v3"})


def test_layout_errors_name_the_expert_sizes():
    assert validate(ParallelConfig(ep=2), 2, mixtral()) == 2  # dense data parallelism is still the whole world
    with pytest.raises(ValueError) as e:
        validate(ParallelConfig(ep=2, etp=2), 2)
    assert str(e.value) == (
        "world size (2) is not divisible by parallel.etp (2) x parallel.ep (2) x parallel.pp (1) = 4: the expert "
        "layers need whole expert-parallel groups in every pipeline stage; change parallel.ep, parallel.etp or the "
        "number of processes")
    with pytest.raises(ValueError, match=r"the number of experts \(4\) is not divisible by parallel.ep \(3\)"):
        validate(ParallelConfig(ep=3), 3, mixtral())


@pytest.mark.parametrize("kwargs, message", [
    (dict(moe_aux_loss_coeff=-0.1), r"model.moe_aux_loss_coeff must be >= 0 \(0 turns it off\), got -0.1"),
    (dict(moe_token_dispatcher="flex"), r"model.moe_token_dispatcher must be one of \('alltoall', 'allgather'\)"),
    (dict(moe_grouped_gemm="yes"), r"model.moe_grouped_gemm must be one of \('auto', 'on', 'off'\)"),
])
def test_model_config_moe_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(ep=0), r"parallel.ep must be a positive integer, got 0"),
    (dict(etp=0), r"parallel.etp must be a positive integer, got 0"),
])
def test_parallel_config_expert_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_missing_transformer_engine_names_become_none():
    from megatron.core.transformer.moe import moe_utils

    moe.define_missing_te_names()
    assert moe_utils.te_general_gemm is None or moe_utils.HAVE_TE  # the router then takes its torch.mm path
    assert moe.define_missing_te_names() == []  # idempotent
