"""Bad input through the real entry points (tools/train_ppo.py alone or under torchrun with 2 workers, and
tools/convert_hf.py; real Megatron-Core and SGLang on CPU, gloo, the tiny model): config typos and wrong types,
model folders that are missing, unreadable or do not match their weights or tokenizer, parallel sizes that do not
fit the model or the world, missing / empty / malformed data, reward functions that raise or return NaN,
conversions onto an existing output or from a truncated file, resumes from a damaged checkpoint, an output folder
that cannot be written and a disk that fills up.

Each case asserts (a) the exit status within a stated bound, never a hang (every launch is bounded and torn down),
(b) the message names the field or file and what to do, (c) nothing written before is lost or half-written, and
that errors of the input come before the engines load. Each records its row of docs/reliability.md.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from mcore_rl.net import free_port
from tests.trainer.conftest import ROOT, tiny_overrides

pytestmark = pytest.mark.slow

EARLY_BOUND_S = 90.0
"""An input error found before the engines load: interpreter, Hydra, torch, Megatron imports and the check, on
a shared 2-core machine (6-8 s alone)."""
RUN_BOUND_S = 300.0
"""A run that starts the engines and trains a step or two (25 s alone)."""
ENGINE_STARTED = "starting the rollout engine"  # our line as the SGLang engine starts (trainer/run.py)


def _launch(args: list[str], nproc: int | None, bound_s: float,
            tool: str = "train_ppo.py") -> tuple[int, str, float, int]:
    """Run a tool (nproc None: plain python, one process; else torchrun), bounded by bound_s. Returns (exit
    status, its output, seconds to exit, processes of its session left alive after it exited)."""
    script = str(ROOT / "tools" / tool)
    cmd = ([sys.executable, script] if nproc is None else
           [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), script]) + args
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("HYDRA_FULL_ERROR", None)
    t0 = time.monotonic()
    tree: dict[int, psutil.Process] = {}  # every process of the run seen (torchrun's workers lead sessions of their
    # own); psutil.Process objects, so that a pid reused after the run is never taken for one of it
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        while proc.poll() is None:
            tree.update({c.pid: c for c in _descendants(proc.pid) if c.pid not in tree})
            if time.monotonic() - t0 > bound_s:
                _kill([*tree.values(), psutil.Process(proc.pid)])
                proc.wait(timeout=30)
                log.seek(0)
                pytest.fail(f"{tool} {' '.join(args[-3:])} did not exit within {bound_s} s (a hang):\n"
                            f"{log.read()[-3000:]}")
            time.sleep(0.1)
        took = time.monotonic() - t0
        log.seek(0)
        out = log.read()
    deadline = time.monotonic() + 10  # stragglers (SGLang's processes) get 10 s to follow
    while _living(tree.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = len(_living(tree.values()))
    _kill(tree.values())
    return proc.returncode, out, took, left


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _living(procs) -> list[psutil.Process]:
    """The processes of `procs` still running (is_running compares start times: a reused pid is not one)."""
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _kill(procs) -> None:
    for p in _living(procs):
        try:
            p.kill()  # psutil refuses a pid that now belongs to another process
        except psutil.NoSuchProcess:
            pass


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("mcore_rl: ")]


def _early(text: str) -> None:
    """The error came before the engines loaded (no SGLang start) and as a line, not a traceback of ours."""
    assert ENGINE_STARTED not in text, text[-3000:]
    assert f'File "{ROOT / "mcore_rl"}' not in text, text[-3000:]


def _fingerprint(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _short(line: str, limit: int = 150) -> str:
    """The line for the table: pytest's temporary folders as <tmp>, cut at `limit` characters."""
    line = re.sub(r"/tmp/pytest-of-[^/]+/pytest-\d+/[^/\s']+", "<tmp>", line.strip())
    return line if len(line) <= limit else line[:limit] + " ..."


@pytest.fixture
def run_args(tiny_model, arith_data, tmp_path):
    """The tiny run's overrides with the output folder in tmp_path."""
    return tiny_overrides(tiny_model, arith_data, str(tmp_path / "run")) + ["trainer.total_steps=1",
                                                                            "trainer.export_hf=false"]


# ---- the command line -----------------------------------------------------------------------------------------
CONFIG_CASES = {
    "unknown key": ("trainer.totl_steps=3", ["unknown config key 'trainer.totl_steps'", "no field 'totl_steps'",
                                              "did you mean trainer.total_steps?", "its fields: "]),
    "string for an int": ("trainer.total_steps=three", ["config key 'trainer.total_steps' takes an integer, got "
                                                        "'three'"]),
    "invalid choice": ("algorithm.adv_estimator=grpoo", ["algorithm.adv_estimator='grpoo' is not one of",
                                                         "did you mean grpo"]),
    "unknown config group option": ("rollout=cpuu", ["Could not find 'rollout/cpuu'", "Available options in "
                                                      "'rollout'", "cpu"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_mistake_is_named_with_what_is_valid(case, run_args, tmp_path, record):
    override, parts = CONFIG_CASES[case]
    code, text, took, left = _launch([*run_args, override], None, EARLY_BOUND_S)
    assert code in (1, 2) and not left, (code, left, text[-3000:])
    for part in parts:
        assert part in text, (part, text[-3000:])
    _early(text)
    assert "Traceback" not in text and not (tmp_path / "run" / "checkpoints").exists(), text[-3000:]
    line = next((ln for ln in text.splitlines() if parts[0] in ln), parts[0])
    record(case=f"config on the command line: {case} (`{override}`)", sees=f"'{_short(line.strip())}', exit "
           f"status {code}", exit_s=round(took, 1), left=left)


# ---- the model folder -----------------------------------------------------------------------------------------
def _model_copy(tiny_model: str, tmp_path: Path, **config) -> Path:
    """A copy of the tiny model with config.json's fields changed (the weights as they were)."""
    out = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(config)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _model_path_case(case: str, tiny_model: str, tmp_path: Path) -> tuple[Path, list[str]]:
    if case == "missing":
        path = tmp_path / "no_such_model"
        return path, [f"HF model folder '{path}' does not exist; check model.path"]
    if case == "folder without config.json":
        path = tmp_path / "model"
        path.mkdir()
        (path / "model.safetensors").write_bytes(Path(tiny_model, "model.safetensors").read_bytes())
        return path, [f"no config.json in '{path}': model.path must be an HF checkpoint folder"]
    if case == "config.json is a folder":
        path = Path(shutil.copytree(tiny_model, tmp_path / "model"))
        (path / "config.json").unlink()
        (path / "config.json").mkdir()
        return path, [f"no config.json in '{path}': model.path must be an HF checkpoint folder"]
    path = Path(tiny_model) / "model.safetensors"  # a file where the folder is expected
    return path, [f"'{path}' is not a JSON config", "model.path must be an HF checkpoint folder, not a file"]


@pytest.mark.parametrize("case", ["missing", "folder without config.json", "config.json is a folder",
                                  "a weights file, not a folder"])
def test_unusable_model_path_is_named(case, tiny_model, run_args, tmp_path, record):
    path, parts = _model_path_case(case, tiny_model, tmp_path)
    code, text, took, left = _launch([*run_args, f"model.path={path}"], None, EARLY_BOUND_S)
    lines = _error_lines(text)
    assert code == 2 and not left and len(lines) == 1, (code, left, text[-3000:])
    for part in parts:
        assert part in lines[0], (part, lines[0])
    _early(text)
    record(case=f"model.path: {case}", sees=f"'{_short(lines[0])}', exit status 2", exit_s=round(took, 1), left=left)


MISMATCH_CASES = {
    "hidden_size": (dict(hidden_size=96), ["tensor 'model.embed_tokens.weight' in ", "model.safetensors has shape "
                                           "[512, 64], expected [512, 96] from ", "config.json",
                                           "use the config.json they were saved with"]),
    "vocab_size": (dict(vocab_size=600), ["tensor 'model.embed_tokens.weight' in ", "has shape [512, 64], expected "
                                          "[600, 64]", "the weights do not match the config"]),
    "num_hidden_layers": (dict(num_hidden_layers=6, layer_types=["full_attention"] * 6),
                          ["has no tensor 'model.layers.4.", "(qwen2, 6 layers) needs; the weights do not match "
                           "the config"]),
}


@pytest.mark.parametrize("case", list(MISMATCH_CASES))
def test_config_not_matching_the_weights_is_named_before_training(case, tiny_model, run_args, tmp_path, record):
    changes, parts = MISMATCH_CASES[case]
    model = _model_copy(tiny_model, tmp_path, **changes)
    code, text, took, left = _launch([*run_args, f"model.path={model}"], None, EARLY_BOUND_S)
    lines = _error_lines(text)
    assert code == 2 and not left and len(lines) == 1, (code, left, text[-3000:])
    for part in parts:
        assert part in lines[0], (part, lines[0])
    assert str(model) in lines[0]
    _early(text)
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
    record(case=f"config.json's {case} changed (weights as they were)", sees=f"'{_short(lines[0], 220)}', exit "
           "status 2", exit_s=round(took, 1), left=left)


def test_tokenizer_not_matching_the_weights_is_named(tiny_model, run_args, tmp_path, record):
    """A tokenizer with more tokens than config.json's vocab_size (one from another model): refused at start, not
    an index error in the engine mid-rollout."""
    from transformers import AutoTokenizer

    model = _model_copy(tiny_model, tmp_path)
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_tokens([f"<extra_{i}>" for i in range(200)])
    tok.save_pretrained(model)
    code, text, took, left = _launch([*run_args, f"model.path={model}"], None, EARLY_BOUND_S)
    lines = _error_lines(text)
    assert code == 2 and not left and len(lines) == 1, (code, left, text[-3000:])
    assert (f"the tokenizer in {model} has {len(tok)} tokens, but config.json's vocab_size is 512: token ids "
            f"512..{len(tok) - 1} have no embedding") in lines[0], lines[0]
    assert "use the tokenizer the model was trained with" in lines[0]
    _early(text)
    record(case="a tokenizer that does not match the weights (more tokens than vocab_size)",
           sees=f"'{_short(lines[0], 160)}', exit status 2", exit_s=round(took, 1), left=left)


# ---- parallel sizes (torchrun, 2 workers) -----------------------------------------------------------------------
LAYOUT_CASES = {
    "parallel.tp=3 on 2 processes": ({}, ["parallel.tp=3"], "world size (2) is not divisible by parallel.tp (3) x "
                                     "parallel.pp (1) = 3; change the number of processes or the layout"),
    "parallel.tp=2 with 1 attention head": (dict(num_attention_heads=1, num_key_value_heads=1), ["parallel.tp=2"],
                                            "num_attention_heads (1) is not divisible by parallel.tp (2); use a "
                                            "parallel.tp that divides 1"),
    "parallel.pp=2 with 3 layers": (dict(num_hidden_layers=3), ["parallel.pp=2"], "num_hidden_layers (3) is not "
                                    "divisible by parallel.pp (2); every pipeline stage holds the same number of "
                                    "layers: choose parallel.pp dividing 3"),
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_parallel_sizes_that_do_not_fit_are_refused_on_every_rank(case, tiny_model, run_args, tmp_path, record):
    changes, overrides, message = LAYOUT_CASES[case]
    model = _model_copy(tiny_model, tmp_path, **changes)
    code, text, took, left = _launch([*run_args, f"model.path={model}", *overrides], 2, EARLY_BOUND_S)
    lines = [ln for ln in _error_lines(text) if message in ln]
    assert code != 0 and not left, (code, left, text[-3000:])
    # Each rank finds the mistake itself and prints it. The first to exit has torchrun stop the other, which on a
    # loaded machine (seen with two test processes on two cores) can come before that one has printed: at least one
    # line, at most one a rank.
    ranks = re.findall(r"\[rank (\d+)\]", "\n".join(lines))
    assert lines and len(ranks) == len(lines) and len(set(ranks)) == len(ranks) <= 2, text[-3000:]
    _early(text)
    assert not (tmp_path / "run" / "checkpoints").exists()
    record(case=f"torchrun, 2 workers: {case}", sees=f"each rank: '{message}', exit status 2",
           exit_s=round(took, 1), left=left)


# ---- data files -----------------------------------------------------------------------------------------------
def _data_case(case: str, tmp_path: Path) -> tuple[Path, list[str]]:
    path = tmp_path / "data.jsonl"
    if case == "missing":
        return path, [f"data file or folder {path} does not exist; check the data's train_files"]
    if case == "empty":
        path.write_text("")
        return path, [f"no usable prompts in ['{path}']: 0 rows", "point the data's train_files at a file with "
                      "prompts"]
    good = json.dumps({"prompt": "What is 1 + 1?", "answer": "2"})
    if case == "malformed JSON line":
        path.write_text(good + "\n" + good + "\n" + '{"prompt": "What is 2 + 2?", "answer": 4\n' + good + "\n")
        return path, [f"{path}, line 3: invalid JSON (Expecting ',' delimiter", "fix the row, or set "
                      "on_bad_row=skip to skip bad rows"]
    path.write_text(good + "\n" + json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n")
    return path, [f"{path}, line 2: missing key 'prompt' (row has ['answer', 'question'])", "fix the row, or set "
                  "on_bad_row=skip"]


@pytest.mark.parametrize("case", ["missing", "empty", "malformed JSON line", "row without the prompt field"])
def test_bad_data_file_is_named_with_its_line(case, run_args, tmp_path, record):
    path, parts = _data_case(case, tmp_path)
    before = path.read_bytes() if path.exists() else None
    code, text, took, left = _launch([*run_args, f"data.train_files=[{path}]"], None, EARLY_BOUND_S)
    lines = _error_lines(text)
    assert code == 2 and not left and len(lines) == 1, (code, left, text[-3000:])
    for part in parts:
        assert part in lines[0], (part, lines[0])
    _early(text)
    assert (path.read_bytes() if path.exists() else None) == before  # the data is never touched
    record(case=f"data.train_files: {case}", sees=f"'{_short(lines[0], 170)}', exit status 2",
           exit_s=round(took, 1), left=left)


# ---- reward functions -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn, problem", [("raises", "ZeroDivisionError: this reward function is broken on purpose"),
                                         ("nan", "returned nan; expected a finite float")])
def test_broken_reward_function_stops_the_run(fn, problem, run_args, tmp_path, record):
    """A reward function that raises or returns a non-finite number on every sample: more than
    reward.max_error_fraction (default 0.5) of the step failed, so the run stops in step 1, naming the function,
    the counts, the first failure and the switch (1.0 trains on reward.fallback_reward instead:
    tests/rewards/test_reward_manager.py); no checkpoint is begun."""
    path = f"tests.reliability.reward_fns:{fn}"
    code, text, took, left = _launch([*run_args, f"reward.function_path={path}"], None, RUN_BOUND_S)
    lines = _error_lines(text)
    assert code == 2 and not left and len(lines) == 1, (code, left, text[-4000:])
    assert (f"reward '{path}' failed on 8 of the step's 8 samples (8 errors, 0 timeouts), more than "
            f"reward.max_error_fraction (0.5) allows. The first failure: {problem}.") in lines[0], lines[0]
    assert "reward.max_error_fraction=1.0" in lines[0]
    assert "RewardError" not in text, text[-3000:]  # a line, not the exception's traceback (the first failures'
    # own tracebacks are logged as warnings, max_logged_errors)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not list(checkpoints.iterdir()), list(checkpoints.iterdir())
    record(case=f"a user reward function that {'raises' if fn == 'raises' else 'returns NaN'} (every sample)",
           sees=f"'{_short(lines[0], 170)}', exit status 2", exit_s=round(took, 1), left=left)


# ---- tools/convert_hf.py ----------------------------------------------------------------------------------------
def _convert(args: list) -> tuple[int, str, float, int]:
    return _launch(["to-mcore", *map(str, args), "--no-progress"], None, EARLY_BOUND_S, tool="convert_hf.py")


def test_conversion_onto_an_existing_output_is_refused(tiny_model, tmp_path, record):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("an earlier conversion's files")
    before = _fingerprint(out)
    code, text, took, left = _convert(["--hf-dir", tiny_model, "--out", out])
    assert code == 2 and not left, (code, text[-3000:])
    line = next(ln for ln in text.splitlines() if "already exists" in ln)
    assert f"output '{out}' already exists; pass --overwrite (overwrite=True) to replace it" in line, line
    assert _fingerprint(out) == before and [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    record(case="convert_hf.py onto an existing output (no --overwrite)", sees=f"'{_short(line)}', exit status 2; "
           "the output untouched", exit_s=round(took, 1), left=left)


def test_conversion_from_a_truncated_safetensors_file_is_refused(tiny_model, tmp_path, record):
    """The through-the-CLI twin of tests/bridge/test_convert_safety.py's in-process cases (sharded, corrupt)."""
    src = Path(shutil.copytree(tiny_model, tmp_path / "hf"))
    weights = src / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 1000)
    code, text, took, left = _convert(["--hf-dir", src, "--out", tmp_path / "ckpt"])
    assert code == 2 and not left, (code, text[-3000:])
    line = next(ln for ln in text.splitlines() if "is truncated or corrupt" in ln)
    assert (f"{weights} is truncated or corrupt: header says {size} bytes, file has {size - 1000}; re-download or "
            "re-export it") in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing written, no lock or temporary left
    record(case="convert_hf.py from a truncated safetensors file", sees="'<file> is truncated or corrupt: header "
           "says N bytes, file has M; re-download or re-export it', exit status 2; nothing written",
           exit_s=round(took, 1), left=left)


@pytest.mark.parametrize("flag, message", [
    (["--tp", 3], "num_attention_heads (4) is not divisible by --tp (3); use a --tp that divides 4"),
    (["--pp", 2], "world size (1) is not divisible by --tp (1) x --pp (2) = 2; change the number of processes or "
                  "the layout"),
], ids=["tp", "pp"])
def test_conversion_at_a_layout_that_does_not_fit_is_refused(flag, message, tiny_model, tmp_path, record):
    code, text, took, left = _convert(["--hf-dir", tiny_model, "--out", tmp_path / "ckpt", *flag])
    assert code == 2 and not left, (code, text[-3000:])
    line = next(ln for ln in text.splitlines() if message in ln)
    assert "convert_hf.py to-mcore: error [rank 0]" in line and not list(tmp_path.iterdir()), line
    record(case=f"convert_hf.py with a wrong {flag[0]} (`{flag[0]} {flag[1]}`, 1 process)",
           sees=f"'{message}', exit status 2; nothing written", exit_s=round(took, 1), left=left)


# ---- resume from a damaged checkpoint --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tiny_model, arith_data, tmp_path_factory) -> Path:
    """An output folder with one complete checkpoint (step 1) of a real single-process run."""
    out = tmp_path_factory.mktemp("trained") / "run"
    code, text, _, _ = _launch(tiny_overrides(tiny_model, arith_data, str(out)) + [
        "trainer.total_steps=1", "trainer.export_hf=false"], None, RUN_BOUND_S)
    assert code == 0, text[-4000:]
    return out


RESUME_CASES = {
    "its rank file missing": ("rank_00000.pt", "{f} is missing: the checkpoint is damaged, or was written by fewer "
                              "ranks"),
    "its rank file truncated": ("rank_00000.pt", "{f} is truncated or corrupt ("),
    "an actor weights file truncated": ("actor/__0_0.distcp", "{f} is truncated: {f.parent}/.metadata lists "),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_from_a_damaged_checkpoint_is_refused(case, trained, tiny_model, arith_data, tmp_path, record):
    """Never a silent fresh start, and nothing of the damaged run's folder changes."""
    name, what = RESUME_CASES[case]
    out = Path(shutil.copytree(trained, tmp_path / "run"))
    damaged = out / "checkpoints" / "step_0000001" / name
    if "missing" in case:
        damaged.unlink()
    else:
        data = damaged.read_bytes()
        damaged.write_bytes(data[: len(data) // 2])
    before = _fingerprint(out / "checkpoints")
    metrics = (out / "metrics.jsonl").read_bytes()
    args = tiny_overrides(tiny_model, arith_data, str(out)) + ["trainer.total_steps=2", "trainer.export_hf=false",
                                                               "trainer.resume=auto"]
    code, text, took, left = _launch(args, None, EARLY_BOUND_S)
    lines = _error_lines(text)
    assert code == 2 and not left and len(lines) == 1, (code, left, text[-3000:])
    assert what.format(f=damaged) in lines[0], lines[0]
    if "weights" in case:
        size = damaged.stat().st_size
        assert f"lists {2 * size} bytes in it, the file has {size}" in lines[0], lines[0]
    assert "from an earlier checkpoint (trainer.resume=<folder>)" in lines[0], lines[0]
    assert "resumed from" not in text  # never a silent fresh start
    _early(text)
    assert _fingerprint(out / "checkpoints") == before and (out / "metrics.jsonl").read_bytes() == metrics
    record(case=f"resume=auto from a checkpoint with {case}", sees=f"'{_short(lines[0], 190)}', exit status 2; "
           "nothing written", exit_s=round(took, 1), left=left)


# ---- the output folder ------------------------------------------------------------------------------------------
def _mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")


def _umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.parametrize("case", ["under a regular file", "on a read-only file system"])
def test_output_folder_that_cannot_be_written_is_named(case, run_args, tmp_path, record):
    """As root, permissions do not stop a write; a path under a regular file and a read-only tmpfs do. Checked
    before Hydra, which makes its log folder in the output folder first."""
    if case == "under a regular file":
        (tmp_path / "a_file").write_text("not a folder")
        out, reason = tmp_path / "a_file" / "run", f"{tmp_path / 'a_file'} is not a folder"
    else:
        _mount_tmpfs(tmp_path / "ro", "ro,size=1m")
        out, reason = tmp_path / "ro" / "run", f"{tmp_path / 'ro'} is on a read-only file system"
    try:
        code, text, took, left = _launch([*run_args, f"trainer.output_dir={out}"], 2, EARLY_BOUND_S)
    finally:
        if case != "under a regular file":
            _umount(tmp_path / "ro")
    lines = _error_lines(text)
    # the output's start and end: a worker's traceback comes first, torchrun's summary of it last
    assert code != 0 and not left and len(lines) == 1, (code, left, text[:5000], text[-2000:])
    assert (f"trainer.output_dir={out} cannot be created or written: {reason}; choose a folder this run can "
            "create and write") in lines[0], lines[0]
    _early(text)
    if case == "under a regular file":
        assert (tmp_path / "a_file").read_text() == "not a folder"
    record(case=f"torchrun, 2 workers: trainer.output_dir {case}", sees=f"from rank 0: 'trainer.output_dir=<path> "
           f"cannot be created or written: {reason.replace(str(tmp_path), '<tmp>')}; choose a folder this run can "
           "create and write', exit status 2", exit_s=round(took, 1), left=left)


def test_full_disk_keeps_the_last_checkpoint(tiny_model, arith_data, tmp_path, record):
    """The output folder on a 5.7 MB tmpfs: step 1's checkpoint (3.6 MB) fits, step 2's does not. The run stops
    at step 2's save naming the folder and the last complete checkpoint; `latest` still points to step 1, whose
    files are as they were, and resume=auto from a copy of it on a roomy disk continues the run."""
    disk = tmp_path / "small"
    _mount_tmpfs(disk, "size=5800k")
    out = disk / "run"
    common = tiny_overrides(tiny_model, arith_data, str(out)) + ["trainer.export_hf=false", "trainer.save_every=1"]
    try:
        code, text, took, left = _launch(common + ["trainer.total_steps=3"], None, RUN_BOUND_S)
        lines = _error_lines(text)
        assert code == 2 and not left and "saved checkpoint" in text, (code, left, text[-4000:])
        assert len(lines) == 1 and lines[0].startswith("mcore_rl: error [rank 0]: OSError: [Errno 28] "), lines
        step1 = out / "checkpoints" / "step_0000001"
        assert (f"could not write the checkpoint of step 2 into {out / 'checkpoints' / 'step_0000002.tmp'}: No "
                "space left on device") in lines[0], lines[0]
        assert (f"; free space in (or choose another) trainer.output_dir. The last complete checkpoint, {step1}, is "
                "intact; continue from it with trainer.resume=auto") in lines[0], lines[0]
        assert (out / "checkpoints" / "latest").read_text().strip() == step1.name
        rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]  # whole rows only
        assert [r["step"] for r in rows] == [1, 2]
        kept = Path(shutil.copytree(out, tmp_path / "moved", ignore=shutil.ignore_patterns("*.tmp", ".lock")))
    finally:
        _umount(disk)
    assert json.loads((kept / "checkpoints" / step1.name / "state.json").read_text())["step"] == 1
    code2, text2, _, _ = _launch(tiny_overrides(tiny_model, arith_data, str(kept)) + [
        "trainer.export_hf=false", "trainer.total_steps=2", "trainer.resume=auto"], None, RUN_BOUND_S)
    assert code2 == 0 and f"resumed from {kept / 'checkpoints' / step1.name} at step 1" in text2, text2[-4000:]
    record(case="the disk fills up while a checkpoint is written (a 5.7 MB tmpfs)", sees="'OSError: [Errno 28] could "
           "not write the checkpoint of step k into <...>/step_k.tmp: No space left on device; free space ... The "
           "last complete checkpoint, <path>, is intact; continue from it with trainer.resume=auto', exit status 2; "
           "resume=auto from it continues", exit_s=round(took, 1), left=left)


def test_metrics_row_is_whole_or_absent_on_a_full_disk(tmp_path):
    """metrics.jsonl on a full file system: the failed append is cut off again (never half a row) and the error
    names the file."""
    from mcore_rl.trainer.metrics import MetricsLogger

    disk = tmp_path / "small"
    _mount_tmpfs(disk, "size=64k")
    try:
        logger = MetricsLogger(str(disk), enabled=True, tensorboard=False)
        logger.log(1, {"reward/mean": 0.5})
        before = (disk / "metrics.jsonl").read_bytes()
        (disk / "filler").write_bytes(b"x" * (64 * 1024 - len(before) - 4096 - 20))  # leaves less than a row
        with pytest.raises(OSError, match=f"could not append step 2 to {disk / 'metrics.jsonl'}: No space left"):
            logger.log(2, {f"metric/{i}": float(i) for i in range(400)})
        assert (disk / "metrics.jsonl").read_bytes() == before
    finally:
        _umount(disk)
