"""WeightSyncConfig: its validation messages and the conf/weight_sync group file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mcore_rl.config.weight_sync import WeightSyncConfig

CONF = Path(__file__).resolve().parents[2] / "conf" / "weight_sync"


def test_group_file_mirrors_the_dataclass():
    from omegaconf import OmegaConf

    raw = OmegaConf.load(CONF / "default.yaml")
    assert set(raw.keys()) == {f.name for f in dataclasses.fields(WeightSyncConfig)}
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(WeightSyncConfig), raw))
    assert cfg == WeightSyncConfig()


@pytest.mark.parametrize("kwargs, message", [
    (dict(transport="nccl"), r"weight_sync.transport must be one of \('tensor', 'distributed', 'disk'\), got 'nccl'"),
    (dict(layout="direct"), r"weight_sync.layout must be one of \('auto', 'hf', 'engine', 'shared'\), got 'direct'"),
    (dict(layout="engine", transport="distributed"),
     r"weight_sync.layout=engine is for colocated syncs and needs weight_sync.transport=tensor, got "
     r"transport=distributed: set weight_sync.layout=auto \(hf for this transport\) or hf"),
    (dict(layout="shared", transport="disk"), r"weight_sync.layout=shared .* needs weight_sync.transport=tensor"),
    (dict(bucket_mb=0), r"weight_sync.bucket_mb must be >= 1, got 0"),
])
def test_invalid_values_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WeightSyncConfig(**kwargs)


def test_engine_loaders_are_needed_unless_the_layout_is_hf():
    assert WeightSyncConfig().engine_loaders and WeightSyncConfig(layout="shared").engine_loaders
    assert not WeightSyncConfig(layout="hf").engine_loaders
    assert WeightSyncConfig(transport="distributed").engine_loaders  # auto: the plan is made later, on the engine
