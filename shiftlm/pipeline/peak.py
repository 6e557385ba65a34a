"""What a schedule holds at once: the most stage-chunk activations on any rank (its memory), a
property of the schedule's order under balanced costs, simulated once per shape with unit costs.

    peak_in_flight("1f1b", pp=4, microbatches=8, chunks=1)  # 4

The trainer's pre-launch memory check and the simulator's memory model both read it here.
"""

from __future__ import annotations

from functools import lru_cache

from shiftlm.pipeline.actions import Schedule
from shiftlm.pipeline.lowering import lower
from shiftlm.pipeline.schedules import build_schedule
from shiftlm.pipeline.simulator import simulate


@lru_cache(maxsize=4096)
def lowered_schedule(name: str, pp: int, microbatches: int, chunks: int) -> Schedule:
    """The lowered schedule, built once per shape (the planner asks for the same shapes many times)."""
    return lower(build_schedule(name, pp, microbatches, chunks=chunks))


@lru_cache(maxsize=4096)
def peak_in_flight(name: str, pp: int, microbatches: int, chunks: int) -> int:
    """Most stage-chunk activations any rank holds at once."""
    return max(simulate(lowered_schedule(name, pp, microbatches, chunks)).peak_activations)
