"""Shared fixtures: one pool of local gloo ranks per world size, reused by every test."""

from __future__ import annotations

import os

import pytest

# servers started by tests run eagerly (no startup compile); tests/serve/test_compiled_decode.py
# covers the compiled decode step
os.environ.setdefault("SHIFTLM_ENFORCE_EAGER", "1")

from shiftlm.launch import Pools


def pytest_sessionstart(session):
    """Build the CPU paged-attention kernel once, before any test: on a fresh machine the first build
    takes ~25 s, which must not land inside a multi-rank test's or a server's start-up timeout (every
    process after this one loads it from the cache)."""
    from shiftlm.kernels import cpu as cpu_kernels

    cpu_kernels.load()


def pytest_collection_modifyitems(config, items):
    """`cuda`-marked tests skip where no CUDA device is visible."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ranks():
    """`ranks.run(world_size, fn, *args)` runs a module-level fn on that many gloo ranks."""
    pools = Pools()
    yield pools
    pools.close()
