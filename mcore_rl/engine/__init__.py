"""Megatron training engine: forward/backward over micro batches, vocab-parallel log-probs, optimizer, checkpoints.

Never imports mcore_rl.algorithms: losses come in as callables (contract in forward_backward.py).
"""

from mcore_rl.engine.batching import MicroBatch, make_micro_batches, pack_sequences, pad_sequences, \
    split_by_token_budget, unpack
from mcore_rl.engine.engine import StepResult, TaskGrad, TaskGradResult, TrainEngine
from mcore_rl.engine.forward_backward import ForwardBackwardResult, forward_backward, global_count
from mcore_rl.engine.logprobs import vocab_parallel_logprobs

__all__ = ["ForwardBackwardResult", "MicroBatch", "StepResult", "TaskGrad", "TaskGradResult", "TrainEngine", "forward_backward", "global_count",
           "make_micro_batches", "pack_sequences", "pad_sequences", "split_by_token_budget", "unpack",
           "vocab_parallel_logprobs"]
