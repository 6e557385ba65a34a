"""When a run stops between steps: on SIGINT/SIGTERM, and when a time-based checkpoint is due.

As torchtitan does, a signal does not kill a training rank: the handler only records it, and at the
next step boundary every rank agrees (one all-reduce of two numbers), saves a checkpoint and returns,
so Ctrl-C or a scheduler's SIGTERM loses at most the step in flight. The same all-reduce carries rank
0's clock: a checkpoint is also written every `checkpoint.every_s` seconds, on every rank at once.
A second signal to a rank is ignored (a terminal's Ctrl-C reaches the ranks and their launcher both);
the launcher (`shiftlm.launch.run_ranks`) stops the ranks at once on a second signal.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The shell's convention: 128 + the signal number (130 Ctrl-C, 143 SIGTERM)."""
    return 128 + signum


class StepBoundary:
    """Catches SIGINT/SIGTERM while the loop runs (main thread only) and decides, the same on every
    rank, whether this step ends the run (`stop`) and whether it is saved (`save_due`)."""

    def __init__(self, every_s: float, device: torch.device):
        self.every_s, self.device = every_s, device
        self.received = 0  # the first signal's number
        self.last_save = time.monotonic()
        self._previous: dict[int, object] = {}
        # rank 0 says so, unless a local launcher (`--nproc`, which sets SHIFTLM_SLOTS) already does
        rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        self.announce = rank0 and "SHIFTLM_SLOTS" not in os.environ

    def __enter__(self) -> StepBoundary:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: object) -> None:
        if not self.received and self.announce:
            name = signal.Signals(signum).name
            os.write(2, f"[shiftlm] {name}: stopping after this step with a checkpoint\n".encode())
        self.received = self.received or signum

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def check(self) -> tuple[int, bool]:
        """(the signal that stops the run, or 0; whether a timed checkpoint is due): rank 0's clock
        and any rank's signal, agreed by every rank."""
        due = self.every_s > 0 and time.monotonic() - self.last_save >= self.every_s
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.received, due
        flags = torch.tensor([float(self.received), float(due and dist.get_rank() == 0)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return int(flags[0].item()), bool(flags[1].item())
