"""shiftlm's CPU kernels (csrc/cpu_kernels.cpp): paged attention of decode rows straight from the KV
cache blocks (serve/paged_attention.py) and the fused RMSNorm and SwiGLU of the no-grad (serving)
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


_lock = threading.Lock()
_state: dict[str, object] = {}


def load():
    """The built extension module (its `paged_attention` function), or None where it cannot be built."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def _build():
    from torch.utils import cpp_extension

    started = time.perf_counter()
    name, flags = _name(), _flags()
    try:  # say where it goes before a first build's silent ~25 s
        where = cpp_extension._get_build_directory(name, False)
        built = any(Path(where).glob(f"{name}*.so"))
    except Exception:  # a private helper of torch's: only the message depends on it
        where, built = "torch's extension cache", True
    if not built:
        log.warning("building shiftlm's CPU kernels (first start only, ~25 s; cached in %s)", where)
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(path) for path in SOURCES],
            extra_cflags=flags,
            verbose=False,
        )
    except Exception as error:  # no compiler, no headers: keep the SDPA path
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        log.warning("the CPU kernels could not be built (%s); using PyTorch ops (gather + SDPA)", reason)
        return None
    seconds = time.perf_counter() - started
    if seconds > 1:
        log.warning("built the CPU kernels in %.1f s (cached for later starts)", seconds)
    return module
