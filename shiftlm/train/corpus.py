"""The embedded default corpus: the Python standard library source installed on this machine.

Every Python install carries a few tens of MB of well-written English-and-code text, so a model can
be trained anywhere without a download. Files are taken in sorted path order (deterministic on a
given Python version) until the byte budget is reached; tests and vendored packages are skipped.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from functools import lru_cache
from pathlib import Path

_SKIPPED_DIRS = {"test", "tests", "site-packages", "idle_test", "__pycache__", "pydoc_data"}
_MAX_FILE_BYTES = 256 * 1024  # a handful of huge generated files would dominate a small corpus


def cache_dir() -> Path:
    """Where shiftlm keeps what it builds once (tokenizers, tokenized data): $SHIFTLM_CACHE or ~/.cache."""
    root = os.environ.get("SHIFTLM_CACHE") or Path.home() / ".cache" / "shiftlm"
    return Path(root)


@lru_cache(maxsize=8)
def stdlib_files(max_bytes: int) -> tuple[Path, ...]:
    """Standard-library `*.py` files in sorted relative-path order, up to `max_bytes` in total.

    Skipped directories are never entered: the stdlib root of a pyenv or system Python holds its
    site-packages, whose walk cost every rank of every run seconds (kept per process: a process that
    trains twice, a test's pooled rank, lists once)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [name for name in subdirs if name not in _SKIPPED_DIRS]
        relative = os.path.relpath(directory, root)
        prefix = "" if relative == "." else Path(relative).as_posix() + "/"
        found.extend(prefix + name for name in names if name.endswith(".py"))
    chosen, total = [], 0
    for relative in sorted(found):
        path = Path(root, relative)
        size = path.stat().st_size
        if size == 0 or size > _MAX_FILE_BYTES:
            continue
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return tuple(chosen)


def stdlib_corpus(max_bytes: int = 4_000_000) -> list[str]:
    """The documents of the embedded corpus, one per source file."""
    return [path.read_text(encoding="utf-8", errors="replace") for path in stdlib_files(max_bytes)]


def corpus_fingerprint(documents: list[str]) -> str:
    """A short content hash, so caches built from a different Python version are not reused."""
    digest = hashlib.sha256()
    for document in documents:
        digest.update(document.encode("utf-8", errors="replace"))
        digest.update(b"\0")
    return digest.hexdigest()[:16]
