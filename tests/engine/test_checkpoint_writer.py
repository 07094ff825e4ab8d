"""engine/checkpoint.warm_writer: the checkpoint writer's result queue (Megatron's, started with spawn: a few
seconds the first save of a process would otherwise pay) starts on a thread, once; a save then uses that queue.
Timing is not asserted (the start-up figure is in engine/checkpoint.py's docstring)."""

from megatron.core.dist_checkpointing.strategies import filesystem_async

from mcore_rl.engine import checkpoint


def test_warm_writer_starts_the_queue_once():
    thread = checkpoint.warm_writer()
    assert thread is not None and thread.daemon
    assert checkpoint.warm_writer() is thread
    thread.join(timeout=120)
    assert not thread.is_alive()
    queue = filesystem_async._results_queue
    assert queue is not None
    assert filesystem_async._get_write_results_queue() is queue  # what a save takes: the warmed queue
