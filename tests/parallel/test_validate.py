"""Layout errors are ValueErrors that name both values and say what to change; raised before anything starts."""

import pytest

from mcore_rl.config.parallel import ParallelConfig
from mcore_rl.parallel import validate

TINY = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4}


def test_dp_is_what_is_left_of_the_world():
    assert validate(ParallelConfig(tp=2, pp=2), 8, TINY) == 2
    assert validate(ParallelConfig(), 3) == 3


def test_world_size_not_divisible_by_tp_times_pp():
    with pytest.raises(ValueError) as e:
        validate(ParallelConfig(tp=2, pp=2), 6)
    assert str(e.value) == ("world size (6) is not divisible by parallel.tp (2) x parallel.pp (2) = 4; change the "
                            "number of processes or the layout")


def test_heads_not_divisible_by_tp():
    with pytest.raises(ValueError) as e:
        validate(ParallelConfig(tp=8), 8, TINY)
    assert str(e.value) == ("num_attention_heads (4) is not divisible by parallel.tp (8); use a parallel.tp that "
                            "divides 4")


def test_query_groups_not_divisible_by_tp():
    with pytest.raises(ValueError) as e:
        validate(ParallelConfig(tp=4), 4, TINY)
    assert str(e.value) == ("num_key_value_heads / query groups (2) is not divisible by parallel.tp (4); each "
                            "tensor-parallel rank needs whole query groups: use a parallel.tp that divides 2")


def test_layers_not_divisible_by_pp():
    with pytest.raises(ValueError) as e:
        validate(ParallelConfig(pp=3), 3, TINY)
    assert str(e.value) == ("num_hidden_layers (4) is not divisible by parallel.pp (3); every pipeline stage holds "
                            "the same number of layers: choose parallel.pp dividing 4")


def test_layers_not_divisible_by_pp_times_vpp():
    with pytest.raises(ValueError) as e:
        validate(ParallelConfig(pp=2, vpp=4), 2, TINY)
    assert str(e.value) == ("num_hidden_layers (4) is not divisible by parallel.pp (2) x parallel.vpp (4) = 8; every "
                            "pipeline stage holds the same number of layers: choose parallel.pp x parallel.vpp "
                            "dividing 4")


def test_heads_without_kv_heads_count_as_groups():
    # num_key_value_heads missing: multi-head attention, groups == heads
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) is not divisible by parallel.tp \(4\)"):
        validate(ParallelConfig(tp=4), 4, {"num_attention_heads": 6, "num_hidden_layers": 2})


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=0), "parallel.tp must be a positive integer, got 0"),
    (dict(pp=-1), "parallel.pp must be a positive integer, got -1"),
    (dict(vpp=2), r"parallel.vpp \(2\) needs pipeline parallelism \(parallel.pp > 1, got 1\)"),
])
def test_parallel_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_initialize_validates_before_starting_anything(monkeypatch):
    import torch.distributed as dist

    from mcore_rl.parallel import initialize

    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"world size \(6\) is not divisible by parallel.tp \(4\)"):
        initialize(ParallelConfig(tp=4), TINY)
    assert not dist.is_initialized()
