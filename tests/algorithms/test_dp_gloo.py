"""Two real DP ranks over gloo (two processes): the Megatron loss-scaling convention of aggregation.py gives the
full-batch loss and parameter gradient after the DP all-reduce, for every aggregation mode."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_rl.algorithms import LOSS_AGG_MODES

WORKER = Path(__file__).with_name("dp_worker.py")


@pytest.mark.slow
def test_two_gloo_ranks_reproduce_full_batch(tmp_path):
    store = tmp_path / "store"
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(rank), "2", str(store), str(tmp_path / f"rank{rank}.json")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(result) == sorted(LOSS_AGG_MODES)
        for mode, r in result.items():
            # float64; the two sides sum identical terms in different orders
            assert r["loss_diff"] < 1e-12, (mode, r)
            assert r["grad_diff"] < 1e-12, (mode, r)
            assert r["grad_norm"] > 1e-3, (mode, r)
            assert r["num_tokens"] == 5 + 8 + 0 + 1 + 7 + 3 + 9 + 2 and r["num_seqs"] == 7, (mode, r)
