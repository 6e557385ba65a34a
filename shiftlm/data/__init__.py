"""Data that ships inside the package: published training measurements and LLM inference traces.

Everything here is read-only, small (compressed where large) and documented with its source, licence and
citation in `README.md` beside this file, so a fresh clone needs nothing outside the repository.

    from shiftlm.data import MEASURED_DIR, trace_path
    trace_path("azure_code")  # .../shiftlm/data/traces/azure_llm_2023_code.csv.gz
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DATA_DIR", "MEASURED_DIR", "TRACES_DIR", "TRACES", "trace_path", "resolve_trace"]

DATA_DIR = Path(__file__).resolve().parent
MEASURED_DIR = DATA_DIR / "measured"
TRACES_DIR = DATA_DIR / "traces"

# the short names users can pass to --trace instead of a path
TRACES = {
    "azure_code": "azure_llm_2023_code.csv.gz",
    "azure_conv": "azure_llm_2023_conv.csv.gz",
}


def trace_path(name: str) -> Path:
    """The shipped trace called `name` (one of `TRACES`)."""
    if name not in TRACES:
        raise ValueError(f"no shipped trace named {name!r}; the shipped traces are {', '.join(TRACES)}")
    return TRACES_DIR / TRACES[name]


def resolve_trace(name_or_path: str | Path) -> Path:
    """A shipped trace's short name (`azure_code`) or a file path, as a path."""
    text = str(name_or_path)
    alias = text.replace("-", "_")
    if alias in TRACES:
        return trace_path(alias)
    return Path(name_or_path)
