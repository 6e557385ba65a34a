"""shiftlm's CPU kernels (csrc/cpu_kernels.cpp): paged attention of decode rows straight from the KV
cache blocks (serve/worker/paged_attention.py) and the fused RMSNorm and SwiGLU of the no-grad (serving)
forward, built on first use with PyTorch's C++ extension loader and cached by it (TORCH_EXTENSIONS_DIR,
default ~/.cache/torch_extensions).

It needs what `torch.compile` needs on CPU (a C++ compiler and Python's headers). Where it cannot be
built, `load()` returns None once, with one warning naming the reason, and serving keeps the
gather + SDPA attention (docs/serving.md "Paged attention kernel").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
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
    """The extension's name, keyed by its sources, flags and torch: two installs (or checkouts) with
    different sources each keep their own build in the shared cache instead of rebuilding each other's,
    and a build is only ever imported by the torch it was built against (`_build` imports it directly)."""
    import torch

    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.read_bytes())
    digest.update(" ".join(_flags()).encode())
    digest.update(torch.__version__.encode())
    return f"shiftlm_cpu_kernels_{digest.hexdigest()[:16]}"


BUILD_ESTIMATE_S = 40
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
    wait on the build lock for the same build), plain rather than a warning."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[shiftlm] {text}", file=sys.stderr, flush=True)


def _build():
    from torch.utils import cpp_extension

    started = time.perf_counter()
    name, flags = _name(), _flags()
    try:
        where = Path(cpp_extension._get_build_directory(name, False))  # a private helper of torch's
    except Exception:  # noqa: BLE001 - without it: torch's loader alone, its lock and all
        return _torch_load(cpp_extension, name, flags, list(SOURCES), announce=None)
    built = where / f"{name}.so"
    with _build_lock(where, quiet=built.is_file()):
        if built.is_file():
            try:  # the name fixes sources, flags and torch: nothing for ninja to check
                return _import(name, built)
            except (ImportError, OSError):  # a build killed while linking: build it again
                pass
        # measured: 40 s on an idle 2-core machine (~20 s of it per C++ file), 70-110 s beside other work
        announce = None if built.is_file() else started
        if announce is not None:
            _announce(
                f"building shiftlm's CPU kernels: first start only, ~{BUILD_ESTIMATE_S} s on 2 cores; cached in {where}"
            )
        return _torch_load(cpp_extension, name, flags, _staged_sources(where), announce)


def _torch_load(cpp_extension, name: str, flags: list[str], sources: list[Path], announce: float | None):
    """Build (or rebuild) with torch's loader; None, after one warning line, where it cannot."""
    try:
        module = cpp_extension.load(
            name=name, sources=[str(p) for p in sources], extra_cflags=flags, verbose=False
        )
    except Exception as error:  # no compiler, no headers: keep the SDPA path
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        if int(os.environ.get("RANK", "0")) == 0:  # one line, not one per rank
            log.warning("the CPU kernels could not be built (%s); using PyTorch ops (gather + SDPA)", reason)
        return None
    if announce is not None:
        _announce(f"built the CPU kernels in {time.perf_counter() - announce:.0f} s (later starts load them)")
    return module


def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _build_lock(where: Path, quiet: bool):
    """Hold the build directory for this process with an OS lock (`flock`), which the kernel releases
    however its holder dies. torch's own build lock is a bare file that a killed process leaves
    behind (a rank killed while torch's loader ran ninja, even over a finished build), and every later
    start then waited on it forever (seen twice here: whole test runs hung). Every shiftlm process
    takes this lock before torch's loader takes torch's, so a torch lock found under it is a dead
    process's, and goes. `quiet`: no line while waiting (a finished build is held for an import only)."""
    where.mkdir(parents=True, exist_ok=True)
    with open(where / "shiftlm.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not quiet:
                _announce("waiting for another process's build of the CPU kernels")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = where / "lock"
            if stale.exists():
                stale.unlink(missing_ok=True)
                _announce(f"removed a build lock left by a killed process: {stale}")
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _staged_sources(where: Path) -> list[Path]:
    """The sources copied into the build directory (content-addressed by `_name`): ninja's build file
    names the sources' paths, so two checkouts with the same sources at different paths rebuilt each
    other's build (80-93 s per server start); from one staged copy, every install builds the same."""
    staged = where / "src"
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
