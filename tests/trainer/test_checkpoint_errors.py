"""Which failed checkpoint writes are reported as the file system's fault (checkpoint.write_error)."""

import errno

from mcore_rl.trainer.checkpoint import write_error


def test_file_system_errors_are_found_in_the_chain():
    full = OSError(errno.ENOSPC, "No space left on device")
    assert write_error(full) is full
    wrapped = RuntimeError("checkpoint failed")
    wrapped.__cause__ = full
    assert write_error(wrapped) is full
    found = write_error(RuntimeError("Worker failure: [Errno 30] Read-only file system: '/ckpt/x'"))
    assert found is not None and found.errno == errno.EROFS


def test_a_socket_error_is_not_taken_for_a_disk_problem(tmp_path):
    """Seen on a GPU run stopped by SIGTERM: torchrun had exited, the save's collective got "Connection refused",
    and the run told the user to free disk space. A peer's socket error is not the folder's fault."""
    refused = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    assert write_error(refused, tmp_path) is None
    wrapped = RuntimeError("barrier failed")
    wrapped.__context__ = refused
    assert write_error(wrapped, tmp_path) is None
