"""Lets PyPI's torchvision import beside the CPU build of torch (needed because SGLang imports torchvision).

PyPI's torchvision wheels are linked against CUDA torch. Beside the CPU torch its C++ extension silently fails to
load, and then `torchvision/_meta_registrations.py` fails at import time with "operator torchvision::nms does not
exist", because it registers fake kernels for `nms` and `qnms` whether or not the extension loaded. Since
transformers imports torchvision whenever it is installed, that error breaks transformers too.

This module declares the two operator schemas (no kernels: calling torchvision.ops.nms still raises) so that
the import succeeds. It does nothing when CUDA torch is present or when the operators already exist.

It is armed at interpreter start-up by `mcore_rl_torchvision_shim.pth`, which tools/setup_env.sh writes into the
virtualenv's site-packages when it installs the CPU torch. Arming costs nothing: it only adds an import hook,
and the schemas are declared the first time anything imports torchvision (transformers, SGLang, or SGLang's
spawned scheduler processes, which is why a .pth file is used instead of an import in our own code).
"""

import sys

_LIB = None
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def install() -> bool:
    """Declare the missing torchvision operator schemas; return True when something was declared."""
    global _LIB
    import importlib.util

    if _LIB is not None or importlib.util.find_spec("torchvision") is None:
        return False
    import torch

    if torch.version.cuda is not None:
        return False
    missing = [n for n in _SCHEMAS if not torch._C._dispatch_has_kernel(f"torchvision::{n}")
               and not _op_exists(n)]
    if not missing:
        return False
    _LIB = torch.library.Library("torchvision", "FRAGMENT")
    for name in missing:
        _LIB.define(_SCHEMAS[name])
    return True


def _op_exists(name: str) -> bool:
    import torch

    try:
        getattr(torch.ops.torchvision, name)
        return True
    except (AttributeError, RuntimeError):
        return False


class _OnTorchvisionImport:
    """Meta-path hook: the first `import torchvision` declares the schemas, then the hook removes itself."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            install()
        return None  # let the normal finders import it


def arm() -> None:
    if not any(isinstance(f, _OnTorchvisionImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnTorchvisionImport())
