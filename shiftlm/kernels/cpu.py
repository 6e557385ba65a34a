"""shiftlm's CPU kernels (csrc/cpu_kernels.cpp): paged attention of decode rows straight from the KV
cache blocks (serve/worker/paged_attention.py) and the fused RMSNorm and SwiGLU of the no-grad (serving)
forward, built on first use with PyTorch's C++ extension loader and cached by it (TORCH_EXTENSIONS_DIR,
default ~/.cache/torch_extensions).

It needs what `torch.compile` needs on CPU (a C++ compiler and Python's headers). Where it cannot be
built, `load()` returns None once, with one warning naming the reason, and serving keeps the
gather + SDPA attention (docs/serving.md "Paged attention kernel").
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
SOURCES = (SOURCE, SOURCE.with_name("shm_exchange.cpp"))  # the second: comm/shm.py's collectives


def _flags() -> list[str]:
    # -fopenmp-simd: the simd loops only; with -fopenmp the .so would bring GCC's OpenMP runtime, whose
    # worker threads spun beside PyTorch's and slowed the step's GEMMs by a third
    # -ffast-math: vectorised expf (glibc's libmvec) in the softmax; the kernel keeps no infinities
    return ["-O3", "-fopenmp-simd", "-ffast-math"] + (
        [] if os.environ.get("SHIFTLM_KERNEL_PORTABLE") else ["-march=native"]
    )


def _name() -> str:
    """The extension's name, keyed by its sources and flags: two installs (or checkouts) with different
    sources each keep their own build in the shared cache instead of rebuilding each other's."""
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.read_bytes())
    digest.update(" ".join(_flags()).encode())
    return f"shiftlm_cpu_kernels_{digest.hexdigest()[:16]}"


BUILD_ESTIMATE_S = 40
# torch's build lock is a bare file that a killed build leaves behind, and every later start then waits
# on it forever; no build took 10 minutes even beside other work (564 s at load 16, the slowest seen)
STALE_LOCK_S = 20 * 60
_lock = threading.Lock()
_state: dict[str, object] = {}


def load():
    """The built extension module (its `paged_attention` function), or None where it cannot be built."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def _announce(text: str) -> None:
    """A progress line on stderr, from one process only (rank 0 of a multi-rank run: the other ranks
    wait on torch's build lock for the same build), plain rather than a warning."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[shiftlm] {text}", file=sys.stderr, flush=True)


def _build():
    from torch.utils import cpp_extension

    started = time.perf_counter()
    name, flags = _name(), _flags()
    try:  # say so before a first build's wait
        where = cpp_extension._get_build_directory(name, False)
        built = any(Path(where).glob(f"{name}*.so"))
    except Exception:  # a private helper of torch's: only the message depends on it
        where, built = "torch's extension cache", True
    if not built and where != "torch's extension cache":
        _clear_stale_lock(Path(where) / "lock")
    if not built:
        # measured: 40 s on an idle 2-core machine (~20 s of it per C++ file), 70-110 s beside other work
        _announce(
            f"building shiftlm's CPU kernels: first start only, ~{BUILD_ESTIMATE_S} s on 2 cores; cached in {where}"
        )
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(path) for path in _staged_sources(where)],
            extra_cflags=flags,
            verbose=False,
        )
    except Exception as error:  # no compiler, no headers: keep the SDPA path
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        if int(os.environ.get("RANK", "0")) == 0:  # one line, not one per rank
            log.warning("the CPU kernels could not be built (%s); using PyTorch ops (gather + SDPA)", reason)
        return None
    if not built:
        _announce(f"built the CPU kernels in {time.perf_counter() - started:.0f} s (later starts load them)")
    return module


def _clear_stale_lock(lock: Path) -> None:
    """Say so when another process's build holds `lock`; remove it once it is older than any build."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
        _announce(f"removed a stale build lock ({age / 60:.0f} min old, left by a killed build): {lock}")
    else:
        _announce(f"waiting for another process's build of the CPU kernels (if none is running: rm {lock})")


def _staged_sources(where: str) -> list[Path]:
    """The sources copied into the build directory (content-addressed by `_name`): ninja's build file
    names the sources' paths, so two checkouts with the same sources at different paths rebuilt each
    other's build (80-93 s per server start); from one staged copy, every install builds the same."""
    if where == "torch's extension cache":
        return list(SOURCES)
    staged = Path(where) / "src"
    staged.mkdir(parents=True, exist_ok=True)
    paths = []
    for path in SOURCES:
        target = staged / path.name
        if not target.is_file() or target.read_bytes() != path.read_bytes():
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            partial.write_bytes(path.read_bytes())
            os.replace(partial, target)  # atomic: a concurrent start reads the old or the new whole
        paths.append(target)
    return paths
