"""The optional extras of pyproject.toml, by the top-level package each one brings.

A module that imports one of these needs `pip install 'shiftlm[EXTRA]'`; the CLI turns the
ModuleNotFoundError into that one line (`missing_extra`), and tests/test_imports.py checks this map
against pyproject.toml.
"""

from __future__ import annotations

import importlib

EXTRAS = {
    "fastapi": "serve",
    "starlette": "serve",
    "pydantic": "serve",
    "uvicorn": "serve",
    "httpx": "serve",
    "llguidance": "serve",
    "pyarrow": "parquet",
}


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The one-line fix for `error` when it is an optional extra's package; else None."""
    package = (error.name or "").split(".")[0]
    extra = EXTRAS.get(package)
    if extra is None:
        return None
    return f"{package} is not installed: this needs the '{extra}' extra, pip install 'shiftlm[{extra}]'"


def require(extra: str) -> None:
    """Import the packages of `extra` now, before any slow work, so that a missing one stops the
    command at once (the CLI turns its ModuleNotFoundError into the install line)."""
    for package, name in EXTRAS.items():
        if name == extra:
            importlib.import_module(package)
