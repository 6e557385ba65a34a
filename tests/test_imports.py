"""Every import the package and its tests make is declared in pyproject.toml.

Two checks, because a package installed by hand on the machine hides a missing declaration from the
first: every module under shiftlm/ imports here (a module that needs an optional extra skips, naming
it, only when that extra is absent), and every third-party package the sources import (read from their
syntax trees, so it fails even where the package happens to be installed) is a declared dependency:
a core one or an extra's for shiftlm/, any of them for tests/.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import pkgutil
import re
import sys
from functools import cache
from pathlib import Path

import pytest

import shiftlm
from shiftlm.extras import EXTRAS, missing_extra

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
# `python -m shiftlm` runs the CLI when imported; its one import (shiftlm.cli) is checked on its own
NOT_IMPORTED = {"shiftlm.__main__"}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_normalise(re.match(r"[A-Za-z0-9_.\-]+", r.strip()).group(0)) for r in requirements}


@cache
def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {name: _requirement_names(reqs) for name, reqs in project["optional-dependencies"].items()}
    return _requirement_names(project["dependencies"]), extras


def _distributions(package: str) -> set[str]:
    """The distributions that provide the import name `package` (itself where none is installed)."""
    found = importlib.metadata.packages_distributions().get(package, [])
    return {_normalise(d) for d in found} or {_normalise(package)}


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether the import sits in a `try` whose handler catches ImportError (an optional feature with
    its own message, such as TensorBoard)."""
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.Try) and child in parent.body:
            for handler in parent.handlers:
                names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                if any(
                    isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names
                ):
                    return True
        child, parent = parent, parents.get(parent)
    return False


def third_party_imports(directory: Path) -> dict[str, list[str]]:
    """Top-level third-party packages imported anywhere (functions included) under `directory`."""
    local = {"shiftlm", "tests", "__future__"} | {p.stem for p in (ROOT / "bench").glob("*.py")}
    found: dict[str, list[str]] = {}
    for file in sorted(directory.rglob("*.py")):
        tree = ast.parse(file.read_text(), str(file))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in local or _guarded(node, parents):
                    continue
                found.setdefault(top, []).append(f"{file.relative_to(directory.parent)}:{node.lineno}")
    return found


def undeclared(imports: dict[str, list[str]], allowed: set[str]) -> list[str]:
    return [
        f"{package} ({where[0]})"
        for package, where in sorted(imports.items())
        if not _distributions(package) & allowed
    ]


def test_every_package_shiftlm_imports_is_declared():
    core, extras = _declared()
    assert undeclared(third_party_imports(ROOT / "shiftlm"), core | set().union(*extras.values())) == []


def test_every_package_the_tests_import_is_declared():
    core, extras = _declared()
    assert undeclared(third_party_imports(ROOT / "tests"), core | set().union(*extras.values())) == []


def test_the_extras_map_names_pyproject_extras():
    """`shiftlm.extras.EXTRAS`, which turns a missing package into its install line, agrees with
    pyproject.toml; and no core dependency's package is listed as optional."""
    core, extras = _declared()
    for package, extra in EXTRAS.items():
        assert _distributions(package) & extras[extra], f"{package} is not in the {extra!r} extra"
        assert not _distributions(package) & core, f"{package} is a core dependency, not optional"


def test_an_undeclared_import_is_caught(tmp_path):
    """The check can fail: a scratch module importing a package nobody declared."""
    (tmp_path / "scratch.py").write_text("def f():\n    from scipy_undeclared_pkg.optimize import nnls\n")
    core, extras = _declared()
    found = third_party_imports(tmp_path)
    assert undeclared(found, core | set().union(*extras.values())) == [
        f"scipy_undeclared_pkg ({tmp_path.name}/scratch.py:2)"
    ]


def _modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(shiftlm.__path__, "shiftlm.")]
    return sorted(set(names) - NOT_IMPORTED)


@pytest.mark.parametrize("module", _modules())
def test_every_module_imports(module):
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        if missing_extra(err) is None:
            raise
        pytest.skip(f"{module}: {missing_extra(err)}")


def test_a_command_whose_extra_is_absent_names_the_install_line(tmp_path):
    """`shiftlm serve` without the serve extra: one line naming `pip install 'shiftlm[serve]'`."""
    import subprocess

    hide = "import sys; sys.modules['fastapi'] = None; from shiftlm.cli import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-c", hide, "serve", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "shiftlm serve: error: fastapi is not installed: this needs the 'serve' extra, pip install 'shiftlm[serve]'"
    ]
