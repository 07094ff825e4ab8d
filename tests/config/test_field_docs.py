"""Every config field is documented where it is defined (a string literal on the line after it), and
docs/configuration.md names every top-level config group."""

import ast
import dataclasses
import importlib
import inspect
import pkgutil
from pathlib import Path

import mcore_rl.config
from mcore_rl.config.root import RLConfig

ROOT = Path(__file__).resolve().parents[2]


def config_modules():
    return [importlib.import_module(f"mcore_rl.config.{m.name}")
            for m in pkgutil.iter_modules(mcore_rl.config.__path__)]


def dataclass_names(module) -> set[str]:
    return {name for name, obj in vars(module).items()
            if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__}


def undocumented_fields(module) -> list[str]:
    """`module.Class.field` for each annotated class-level field of a dataclass defined in `module` that is not
    followed by a string-literal expression statement."""
    names = dataclass_names(module)
    tree = ast.parse(Path(module.__file__).read_text())
    missing = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or node.name not in names:
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            if stmt.target.id.startswith("_"):
                continue
            nxt = body[i + 1] if i + 1 < len(body) else None
            documented = (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                          and isinstance(nxt.value.value, str))
            if not documented:
                missing.append(f"{module.__name__.rsplit('.', 1)[-1]}.{node.name}.{stmt.target.id}")
    return missing


def test_the_check_sees_every_config_dataclass():
    # guards against a check that passes because it looks at nothing: nested and base dataclasses included
    found = {f"{m.__name__.rsplit('.', 1)[-1]}.{name}" for m in config_modules() for name in dataclass_names(m)}
    assert {"root.RLConfig", "root.TaskSpec", "rl.ActorConfig", "optim.OptimConfig", "data._FileDataConfig",
            "reward.RemoteRewardConfig", "multitask.TaskDataConfig", "multitask.DPOSettings",
            "trainer.LoggerConfig", "weight_sync.WeightSyncConfig"} <= found


def test_the_check_reports_a_field_without_docstring(tmp_path, monkeypatch):
    (tmp_path / "fake_cfg.py").write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass C:\n"
        "    a: int = 1\n    \"\"\"documented\"\"\"\n    b: int = 2\n    _c: int = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert undocumented_fields(importlib.import_module("fake_cfg")) == ["fake_cfg.C.b"]


def test_every_config_field_has_a_docstring():
    missing = [name for module in config_modules() for name in undocumented_fields(module)]
    assert not missing, "config fields without a docstring on the line after them:\n  " + "\n  ".join(missing)


def test_configuration_doc_names_every_group():
    groups = [f.name for f in dataclasses.fields(RLConfig)]
    assert set(groups) >= {"model", "parallel", "actor", "critic", "ref", "rollout", "algorithm", "data", "reward",
                           "trainer", "logger", "tasks", "multitask", "weight_sync"}
    text = (ROOT / "docs" / "configuration.md").read_text()
    absent = [g for g in groups if f"`{g}`" not in text]
    assert not absent, f"docs/configuration.md does not mention the config groups {absent}"
