"""Not the real sgl_kernel: loads mcore_rl's pure-torch CPU stand-in (see mcore_rl/rollout/sgl_kernel_stand_in.py).

This directory is put on sys.path / PYTHONPATH only on machines without CUDA, so that SGLang's spawned
scheduler and detokenizer processes find the stand-in when they import sgl_kernel.
"""

import sys

from mcore_rl.rollout import sgl_kernel_stand_in

sys.modules[__name__] = sgl_kernel_stand_in.stand_in_module()
