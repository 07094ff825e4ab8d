"""Not the real sgl_kernel: loads mcore_rl's pure-torch CPU stand-in (see mcore_rl/rollout/cpu_compat.py).

This directory is put on sys.path / PYTHONPATH only on machines without CUDA, so that SGLang's spawned
scheduler and detokenizer processes find the stand-in when they import sgl_kernel.
"""

import sys

from mcore_rl.rollout import cpu_compat

sys.modules[__name__] = cpu_compat.stand_in_module()
