"""The import graph by layer (docs/architecture.md, "Layers"), read from the source with `ast`, so a
lazy import inside a function counts as much as one at the top of a file.

A unit is a top-level module (`config`, `mesh`, ...) or a package (`model`, `serve`, ...). Each may
import only the units `ALLOWED` lists for it; no module imports a `cli` module (the `shiftlm` command
dispatches to them by name) except a CLI registering its sub-commands; no module imports another
module's private (`_name`) names; every package declares its public names in `__all__`. Inside
`serve/`, the rooms follow `SERVE_ALLOWED` (http -> engine -> plan <- worker). No two modules import
each other, directly or round a longer circle, at any depth.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "shiftlm"

BASE = {"errors", "config", "parallel", "hardware", "presets", "data", "extras", "kernels"}
ALLOWED: dict[str, set[str]] = {
    "__init__": {"serve"},  # `from shiftlm import LLM, SamplingParams` (serve/llm.py), imported lazily
    "errors": set(),  # the user errors and exit codes: every unit may raise them
    "config": {"errors"},
    "parallel": {"errors", "config"},
    "hardware": {"errors"},
    "data": {"errors"},
    "extras": {"errors"},
    "kernels": set(),  # the C++ sources and their loader: the lowest layer, beside config
    "presets": {"errors", "config", "parallel"},
    "comm": {"errors", "config", "parallel", "kernels"},
    "mesh": {"errors", "config", "parallel", "comm"},
    "monitor": {"errors", "config", "parallel", "comm", "mesh"},
    "launch": {"errors", "config", "parallel", "comm", "mesh", "monitor"},
    "model": {"errors", "config", "parallel", "comm", "mesh", "kernels"},
    "pipeline": {"errors", "config", "parallel", "comm", "mesh", "model", "kernels"},
    # verify and parity run layouts on local ranks (`launch.LocalWorkers`) against transformers
    "tools": {"errors", "config", "parallel", "comm", "mesh", "launch", "model"},
    "serve": BASE | {"comm", "mesh", "monitor", "launch", "model"},
    "train": BASE | {"comm", "mesh", "monitor", "launch", "model", "pipeline"},
    # sim/calibrate_comm.py times point-to-point and the shared-memory collectives through comm (with
    # kernels.cpu, their C++ side), as the pipeline executor and the serving runner use them
    "sim": BASE | {"comm", "model", "launch", "pipeline", "serve"},
    "cli": {"errors", "config", "parallel", "extras"},
    "__main__": {"errors", "cli"},
}
# Inside serve/: the HTTP front talks to the engine, the engine and the workers meet in the plan; no
# room imports the launcher's top-level modules (options, server, cli), which join the rooms.
SERVE_ALLOWED: dict[str, set[str]] = {
    "http": {"http", "engine", "plan"},
    "engine": {"engine", "plan"},
    "worker": {"worker", "plan"},
    "plan": set(),
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
            room = serve_room(where)
            if room is not None and module.startswith("shiftlm.serve."):
                target = module.split(".")[2]
                if target not in SERVE_ALLOWED[room]:
                    found.append(f"{where}:{line}: serve/{room} imports serve/{target} ({module})")
            if is_cli(module) and not is_cli(where.removesuffix(".py")) and where != "__main__.py":
                found.append(f"{where}:{line}: imports the cli module {module}")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                found.append(f"{where}:{line}: imports private {', '.join(private)} from {module}")
    return found


def serve_room(where: str) -> str | None:
    """The room of a module under serve/ (`plan` for serve/plan.py), None for the launcher's modules."""
    parts = where.removesuffix(".py").split("/")
    if parts[0] != "serve" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in SERVE_ALLOWED else None


def module_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the shiftlm modules it imports (at any depth; `from pkg import mod` is mod)."""

    def name_of(path: Path) -> str:
        parts = path.relative_to(root.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name_of(path): path for path in root.rglob("*.py")}

    def resolve(target: str) -> str:
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        return target

    graph = {}
    for name, path in modules.items():
        edges = set()
        for module, names, _ in imports(path):
            edges |= {
                f"{module}.{n}" if f"{module}.{n}" in modules else resolve(module) for n in names or [""]
            }
        graph[name] = {edge for edge in edges if edge in modules and edge != name}
    return graph


def import_circles(root: Path) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    graph, index, low, stack, on_stack, circles = module_graph(root), {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


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


def test_no_module_imports_a_module_that_imports_it_back():
    assert import_circles(ROOT) == []


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
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":  # names served lazily
                defined |= {
                    c.value
                    for c in ast.walk(node)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                }
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


def test_the_checker_keeps_the_serving_rooms_apart(tmp_path):
    root = _tree(
        tmp_path,
        {
            "serve/engine/core.py": "def f():\n    from shiftlm.serve.worker.runner import ModelRunner\n",
            "serve/worker/runner.py": "from shiftlm.serve.plan import StepPlan\n",
            "serve/http/app.py": "from shiftlm.serve.engine.core import Engine\n",
            "serve/worker/logits.py": "from shiftlm.serve.http.protocol import ApiError\n",
            "serve/plan.py": "from shiftlm.serve.options import ServeSetup\n",
            "serve/server.py": "from shiftlm.serve.http.app import build_app\n",
        },
    )
    assert violations(root) == [
        "serve/engine/core.py:2: serve/engine imports serve/worker (shiftlm.serve.worker.runner)",
        "serve/plan.py:1: serve/plan imports serve/options (shiftlm.serve.options)",
        "serve/worker/logits.py:1: serve/worker imports serve/http (shiftlm.serve.http.protocol)",
    ]


def test_the_checker_finds_a_circle_hidden_in_functions(tmp_path):
    root = _tree(
        tmp_path,
        {
            "serve/engine/core.py": "def f():\n    from shiftlm.serve.engine.streams import check\n",
            "serve/engine/streams.py": "def g():\n    from shiftlm.serve.engine import core\n",
            "serve/engine/text.py": "from shiftlm.serve.engine.core import f\n",
        },
    )
    assert import_circles(root) == [["shiftlm.serve.engine.core", "shiftlm.serve.engine.streams"]]
