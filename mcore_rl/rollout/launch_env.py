"""Hide torchrun's rendezvous variables while SGLang starts processes or forms process groups.

Inside a torchrun worker, TORCHELASTIC_USE_AGENT_STORE=True makes every tcp:// rendezvous connect to the
elastic agent's store as a client instead of hosting its own, and RANK / WORLD_SIZE / MASTER_* describe the
trainer's world, not the engine's. SGLang's child processes inherit the environment, and a weight-update group
formed in the trainer process reads it too; either then waits forever. Used around engine start-up and the
weight-update group's creation; a no-op outside torchrun.
"""

from __future__ import annotations

import contextlib
import os

TORCHRUN_VARS = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                           "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"})


@contextlib.contextmanager
def without_torchrun_env():
    names = [k for k in os.environ if k in TORCHRUN_VARS or k.startswith("TORCHELASTIC_")]
    saved = {k: os.environ.pop(k) for k in names}
    try:
        yield
    finally:
        os.environ.update(saved)
