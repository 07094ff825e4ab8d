"""Fixtures of the fault suite. With RELIABILITY_RESULTS=<file.jsonl> set, every case appends what it measured
(what the user sees, time to exit, processes left) to that file; tools/reliability_table.py turns it into the
table of docs/reliability.md."""

import json
import os

import pytest

from tests.trainer.conftest import arith_data, tiny_model  # noqa: F401  (the same session fixtures)


@pytest.fixture
def record(request):
    """record(case=..., sees=..., exit_s=..., left=...): one row of docs/reliability.md."""
    path = os.environ.get("RELIABILITY_RESULTS")

    def write(**row):
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": request.node.name, **row}) + "\n")

    return write
