"""shiftlm's own C++ kernels (csrc/), built at first use: `cpu` (paged decode attention, fused
RMSNorm and SwiGLU, and the shared-memory exchange that `comm/shm.py` runs its collectives on).
The lowest layer beside `config`: `comm`, `model`, `pipeline`, `serve` and `sim` load it."""

__all__ = ["cpu"]
