"""mcore-rl: reinforcement learning for LLMs on Megatron-Core, with SGLang rollouts."""

__version__ = "0.1.0"

from mcore_rl.cuda_libs import align_cudnn_for_te as _align_cudnn_for_te

_align_cudnn_for_te()  # before megatron.core imports Transformer Engine: one cuDNN per process (cuda_libs.py)
