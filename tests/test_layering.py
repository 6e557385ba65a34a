"""The import graph by layer (docs/architecture.md, "Layers"), read from the source with `ast`, so a
lazy import inside a function counts as much as one at the top of a file.

A unit is a top-level module (`config`, `mesh`, ...) or a package (`model`, `serve`, ...). Each may
import only the units `ALLOWED` lists for it; no module imports a `cli` module (the `shiftlm` command
dispatches to them by name) except a CLI registering its sub-commands; no module imports another
module's private (`_name`) names; every package declares its public names in `__all__`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "shiftlm"

BASE = {"config", "hardware", "presets", "data", "extras"}
ALLOWED: dict[str, set[str]] = {
    "__init__": set(),
    "config": set(),
    "hardware": set(),
    "data": set(),
    "extras": set(),
    "presets": {"config"},
    "comm": {"config"},
    "mesh": {"config", "comm"},
    "monitor": {"config", "comm", "mesh"},
    "launch": {"config", "comm", "mesh", "monitor"},
    # model/verify.py and model/parity.py run layouts on local ranks (`launch.LocalWorkers`)
    "model": {"config", "comm", "mesh", "launch"},
    "pipeline": {"config", "comm", "mesh", "model"},
    "serve": BASE | {"comm", "mesh", "monitor", "launch", "model"},
    "train": BASE | {"comm", "mesh", "monitor", "launch", "model", "pipeline"},
    # sim/calibrate_comm.py times point-to-point and the shared-memory collectives through comm (with
    # model.cpu_kernels, their C++ side), as the pipeline executor and the serving runner use them
    "sim": BASE | {"comm", "model", "launch", "pipeline", "serve", "train"},
    "cli": {"config", "extras"},
    "__main__": {"cli"},
}
# The pre-launch checks of `shiftlm train` price the run with the simulator's memory model (one
# memory model, not a second copy in train/): the only files of train/ that may import sim/.
TRAIN_USES_SIM = {"train/preflight.py", "train/dryrun.py"}


def unit_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return parts[0]


def is_cli(module: str) -> bool:
    return module.rsplit(".", 1)[-1].endswith("cli")


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names imported from it, line) for every `shiftlm` import in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "shiftlm":
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "shiftlm"]
    return found


def violations(root: Path) -> list[str]:
    """Every import that breaks the layering, as `file:line: what`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        unit, where = unit_of(path, root), path.relative_to(root).as_posix()
        allowed = ALLOWED.get(unit, set())
        for module, names, line in imports(path):
            targets = [module] + [f"{module}.{name}" for name in names if module == "shiftlm"]
            for target in targets:
                parts = target.split(".")
                if len(parts) < 2 or parts[1] in (unit, "__version__"):
                    continue
                if parts[1] not in allowed and not (parts[1] == "sim" and where in TRAIN_USES_SIM):
                    found.append(f"{where}:{line}: {unit} imports {parts[1]} ({target})")
            if is_cli(module) and not is_cli(where.removesuffix(".py")) and where != "__main__.py":
                found.append(f"{where}:{line}: imports the cli module {module}")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                found.append(f"{where}:{line}: imports private {', '.join(private)} from {module}")
    return found


def packages_without_all(root: Path) -> list[str]:
    missing = []
    for init in sorted(root.rglob("__init__.py")):
        tree = ast.parse(init.read_text())
        declared = any(
            isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
            for node in tree.body
        )
        if not declared:
            missing.append(init.parent.relative_to(root.parent).as_posix())
    return missing


def test_every_import_follows_the_layers():
    assert violations(ROOT) == []


def test_every_unit_has_a_layer_rule():
    units = {unit_of(path, ROOT) for path in ROOT.rglob("*.py")}
    assert units <= set(ALLOWED), f"add a rule for {sorted(units - set(ALLOWED))}"


def test_every_package_declares_its_public_names():
    assert packages_without_all(ROOT) == []


def test_every_name_in_a_package_all_exists():
    for init in ROOT.rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                defined |= {alias.asname or alias.name for alias in node.names}
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined |= {t.id for t in targets if isinstance(t, ast.Name)}
        modules = {p.stem for p in init.parent.glob("*.py")} | {
            p.name for p in init.parent.iterdir() if p.is_dir()
        }
        public = next(
            n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__"
        )
        for name in ast.literal_eval(public):
            assert name in defined or name in modules, f"{init}: __all__ names {name!r}, which does not exist"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "shiftlm"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_checker_catches_an_upward_import_even_inside_a_function(tmp_path):
    root = _tree(
        tmp_path, {"model/layers.py": "def f():\n    from shiftlm.serve.engine.core import Engine\n"}
    )
    assert violations(root) == ["model/layers.py:2: model imports serve (shiftlm.serve.engine.core)"]


def test_the_checker_catches_train_importing_sim_cli_modules_and_private_names(tmp_path):
    root = _tree(
        tmp_path,
        {
            "train/trainer.py": "from shiftlm.sim.memory import estimate_memory\n",
            "train/quickstart.py": "from shiftlm.train.cli import launch\n",
            "serve/http/app.py": "from shiftlm.serve.http.protocol import _Fields\n",
        },
    )
    assert violations(root) == [
        "serve/http/app.py:1: imports private _Fields from shiftlm.serve.http.protocol",
        "train/quickstart.py:1: imports the cli module shiftlm.train.cli",
        "train/trainer.py:1: train imports sim (shiftlm.sim.memory)",
    ]


def test_the_checker_finds_a_package_without_all(tmp_path):
    root = _tree(tmp_path, {"pipeline/__init__.py": '"""Pipelines."""\n'})
    assert packages_without_all(root) == ["shiftlm/pipeline"]
