"""The engine's side of weight syncs (WeightReceiver) against a fake SGLang backend that runs our loaders on a
small torch module, as SGLang's scheduler does: the session state machine, the version count, when the cache is
flushed, the engine-layout name check and its refusal before anything reaches the engine. The same against real
SGLang: tests/rollout/test_engine.py, test_server.py and tests/weight_sync/test_sync_layout.py."""

from __future__ import annotations

import importlib

import pytest
import torch

from mcore_rl.rollout.backend import Backend
from mcore_rl.rollout.errors import RolloutEngineError
from mcore_rl.weight_sync.loaders import LOADERS
from mcore_rl.weight_sync.plan import EngineFacts
from mcore_rl.weight_sync.receiver import WeightReceiver


class FakeBackend(Backend):
    """SGLang 0.5.23's calls on a torch module: update sessions, tensor updates (our loaders by name, "direct"
    copies, or HF tensors recorded as they are), cache flushes and disk reloads, each logged."""

    name = "fake"

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.register_parameter("w", torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False))
        self.model.register_parameter("b", torch.nn.Parameter(torch.zeros(4), requires_grad=False))
        self.log: list[tuple] = []

    def begin_weight_update(self) -> bool:
        self.log.append(("begin",))
        return True

    def end_weight_update(self):
        self.log.append(("end",))
        return True, ""

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool, load_format: str | None = None):
        named_tensors = list(named_tensors)
        self.log.append(("update", load_format.rsplit(".", 1)[-1] if load_format else None, flush_cache))
        if load_format in LOADERS:
            module, fn = load_format.rsplit(".", 1)
            getattr(importlib.import_module(module), fn)(self.model, named_tensors)
        elif load_format == "direct":
            params = dict(self.model.named_parameters())
            for name, t in named_tensors:
                params[name].data.copy_(t)
        return True, ""

    refuse_flushes = 0
    """How many flushes to refuse first, as SGLang does while its scheduler still holds requests."""

    def flush_cache(self):
        self.log.append(("flush",))
        if self.refuse_flushes > 0:
            self.refuse_flushes -= 1
            return False, "Cache not flushed because there are pending requests. #queue-req: 0, #running-req: 1"
        return True, ""

    def update_weights_from_disk(self, model_path: str):
        self.log.append(("disk", model_path))
        return True, ""


def receiver(**facts) -> tuple[WeightReceiver, FakeBackend]:
    backend = FakeBackend()
    return WeightReceiver(backend, EngineFacts(**facts), timeout_s=30.0), backend


def test_one_sync_is_one_session_one_flush_and_one_version():
    weights, backend = receiver()
    with weights.weight_update():
        weights.update_bucket([("model.w", torch.ones(2))])
        weights.update_bucket([("model.b", torch.ones(2))])
        assert weights.sync_open
    assert weights.version == 1 and not weights.sync_open and weights.stale is None
    assert backend.log == [("begin",), ("update", None, False), ("update", None, False), ("end",), ("flush",)]
    assert weights.update_weights_from_tensors([("model.w", torch.ones(2))], flush_cache=False) == 2
    assert backend.log[-1] == ("end",)  # no flush asked for


def test_a_refused_flush_is_asked_again_until_the_scheduler_is_idle():
    weights, backend = receiver()
    backend.refuse_flushes = 3  # requests of the generation that just returned, not yet retired
    weights.update_weights_from_tensors([("model.w", torch.ones(2))])
    assert weights.version == 1 and backend.log.count(("flush",)) == 4
    slow = WeightReceiver(backend, EngineFacts(), timeout_s=0.3)  # bounded by the call timeout when shorter
    backend.refuse_flushes = 10 ** 6  # a scheduler that stays busy: an error naming why, after the bound
    with pytest.raises(RolloutEngineError, match=r"refused to flush the cache \(it refuses while requests are "
                                                 r"running\): Cache not flushed because there are pending"):
        slow.flush_cache()


def test_a_failed_sync_leaves_the_session_bumps_nothing_and_is_remembered():
    weights, backend = receiver()
    with pytest.raises(OSError, match="lost a shard"):
        with weights.weight_update():
            weights.update_bucket([("model.w", torch.ones(2))])
            raise OSError("lost a shard")
    assert weights.version == 0 and weights.stale == "OSError: lost a shard"
    assert backend.log[-1] == ("end",) and ("flush",) not in backend.log
    weights.begin_update()
    weights.abort_update("export failed on another rank")
    assert not weights.sync_open and weights.stale == "export failed on another rank" and weights.version == 0
    weights.abort_update()  # no sync open: nothing
    weights.update_weights_from_tensors([("model.w", torch.ones(2))])
    assert weights.stale is None and weights.version == 1


def test_misuse_is_reported():
    weights, _ = receiver()
    with pytest.raises(RuntimeError, match=r"update_bucket\(\) needs an open weight sync"):
        weights.update_bucket([])
    weights.begin_update()
    with pytest.raises(RuntimeError, match="already open"):
        weights.begin_update()
    with pytest.raises(RuntimeError, match="while a weight sync is open"):
        weights.update_weights_from_disk("/m")
    with pytest.raises(ValueError, match="layout must be hf or engine, got 'shared'"):
        weights.update_bucket([("w", torch.ones(1))], layout="shared")
    weights.end_update()
    released = WeightReceiver(FakeBackend(), EngineFacts(), 30.0, weights_released=lambda: True)
    with pytest.raises(RuntimeError, match=r"resume_memory\(\['weights'\]\) first"):
        released.begin_update()


def test_engine_layout_buckets_are_checked_then_copied_from_one_buffer():
    weights, backend = receiver()
    flat = torch.arange(10.0)
    with weights.weight_update():
        weights.update_bucket([("w", flat[:6].view(2, 3)), ("b", flat[6:])], layout="engine")
    assert torch.equal(backend.model.w, flat[:6].view(2, 3)) and torch.equal(backend.model.b, flat[6:])
    # the parameter table was asked once, in the sync's own session; the bucket went as one flat buffer
    assert [e for e in backend.log if e[0] == "update"] == [("update", "describe", False),
                                                             ("update", "load_flat", False)]
    before = len(backend.log)
    with pytest.raises(ValueError, match="not engine parameters: model.w"):
        with weights.weight_update():
            weights.update_bucket([("model.w", torch.ones(2, 3))], layout="engine")
    assert ("update", None, False) not in backend.log[before:] and weights.version == 1  # refused before SGLang
    weights.update_weights_from_tensors([("w", torch.ones(2, 3))])  # a separate tensor: load_format="direct"
    with weights.weight_update():
        weights.update_bucket([("w", torch.full((2, 3), 2.0))], layout="engine")
    assert backend.log[-3] == ("update", "direct", False) and torch.equal(backend.model.w, torch.full((2, 3), 2.0))


def test_shared_parameters_flush_within_the_copy_unless_requests_may_run():
    weights, backend = receiver()
    source = [torch.full((2, 3), 5.0), torch.full((4,), 7.0)]
    weights.share_parameters(source, [["w", [2, 3], 0, 2], ["b", [4], 1, 4]])
    token = weights.shared_token
    assert token is not None
    with weights.weight_update():
        weights.update_from_shared()
    assert torch.equal(backend.model.w, source[0]) and torch.equal(backend.model.b, source[1])
    assert backend.log[-2:] == [("update", "apply_shared", True), ("end",)]  # flushed by the copy call itself
    may_run = WeightReceiver(backend, EngineFacts(), 30.0, requests_may_run=lambda: True)
    may_run.share_parameters(source, [["w", [2, 3], 0, 2], ["b", [4], 1, 4]])
    with may_run.weight_update():
        may_run.update_from_shared()
    assert backend.log[-3:] == [("update", "apply_shared", False), ("end",), ("flush",)]
    with pytest.raises(ValueError, match=r"the shared parameters does not match.*shape mismatches: w \(3, 2\)"):
        weights.share_parameters(source, [["w", [3, 2], 0, 3], ["b", [4], 1, 4]])
    assert weights.shared_token == token


def test_unshare_drops_the_engine_handles_in_a_session_of_its_own():
    from mcore_rl.weight_sync import loaders

    weights, backend = receiver()
    weights.unshare_parameters()  # nothing shared yet: no call at all
    assert backend.log == []
    source = [torch.full((2, 3), 5.0), torch.full((4,), 7.0)]
    weights.share_parameters(source, [["w", [2, 3], 0, 2], ["b", [4], 1, 4]])
    with weights.weight_update():
        weights.update_from_shared()
        with pytest.raises(RuntimeError, match="inside an open weight sync"):
            weights.unshare_parameters()
    assert loaders._SHARED["sources"][0].data_ptr() == source[0].data_ptr() and "program" in loaders._SHARED
    del backend.log[:]
    weights.unshare_parameters()
    assert backend.log == [("begin",), ("update", "unshare", False), ("end",)]  # no flush, no version
    assert loaders._SHARED == {} and weights.shared_token is None and weights.version == 1
    with pytest.raises(RuntimeError, match=r"before share_parameters"), weights.weight_update():
        weights.update_from_shared()


def test_without_our_loaders_the_engine_layout_says_why():
    weights, _ = receiver(weight_loaders=False)
    with pytest.raises(ValueError, match=r"cannot list the engine's parameters: the engine was started without our "
                                         r"weight loaders \(weight_sync.layout=hf"):
        weights.engine_parameters()


def test_disk_reload_is_a_complete_sync():
    weights, backend = receiver()
    weights.stale = "an earlier failure"
    assert weights.update_weights_from_disk("/ckpt") == 1 and weights.stale is None
    assert backend.log == [("disk", "/ckpt"), ("flush",)]


def test_closing_the_shared_sender_survives_an_engine_that_fails_the_unshare(caplog):
    from types import SimpleNamespace

    from mcore_rl.weight_sync.shared import SharedSender

    weights, backend = receiver()
    weights.share_parameters([torch.zeros(2, 3), torch.zeros(4)], [["w", [2, 3], 0, 2], ["b", [4], 1, 4]])

    def refuse(named_tensors, flush_cache, load_format=None):
        return False, "the scheduler is busy"

    backend.update_weights_from_tensor = refuse
    SharedSender(SimpleNamespace(receiver=weights)).close()  # logs, does not raise: the shutdown goes on
    assert "did not drop the shared parameters" in caplog.text and "the scheduler is busy" in caplog.text
    assert backend.log[-1] == ("end",)  # the session it opened is closed again
    SharedSender(None).close()  # ranks other than 0 hold nothing
