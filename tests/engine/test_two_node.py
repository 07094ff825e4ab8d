"""Two torchrun "nodes" on this machine (--nnodes 2, one process each, static rendezvous at 127.0.0.1) train one
step at DP=2 (two_node_worker.py)."""

import json

import pytest


@pytest.fixture(scope="module")
def reports(tmp_path_factory, tiny_models, torchrun_nodes):
    out = tmp_path_factory.mktemp("two_node")
    torchrun_nodes("two_node_worker.py", 2, out, tiny_models)
    return [json.loads((out / "two_node" / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_nodes_form_one_dp2_world(reports):
    assert [r["layout"] for r in reports] == [
        {"world": 2, "dp": 2, "rank": 0, "local_rank": 0}, {"world": 2, "dp": 2, "rank": 1, "local_rank": 0}]


def test_step_loss_is_the_full_batch_loss(reports):
    # fp32, reduction order only (see test_parity.py): relative 1e-5
    for r in reports:
        assert r["loss"] == pytest.approx(reports[0]["local_full_batch_loss"], rel=1e-5)
    assert reports[0]["grad_norm"] == reports[1]["grad_norm"] > 0


def test_replicas_stay_identical_after_the_step(reports):
    for r in reports:
        assert not r["replicas_unlike_rank0"] and r["moved"] > 0, r
