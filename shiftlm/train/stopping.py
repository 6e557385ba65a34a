"""When a run stops between steps: on SIGINT/SIGTERM, and when a time-based checkpoint is due.

As torchtitan does, a signal does not kill a training rank: the handler only records it, and at the
next step boundary every rank agrees (one all-reduce of two numbers), saves a checkpoint and returns,
so Ctrl-C or a scheduler's SIGTERM loses at most the step in flight. The same all-reduce carries rank
0's clock: a checkpoint is also written every `checkpoint.every_s` seconds, on every rank at once.
A second signal to a rank is ignored (a terminal's Ctrl-C reaches the ranks and their launcher both);
the launcher (`shiftlm.launch.run_ranks`) stops the ranks at once on a second signal.

A rank that cannot reach the boundary (hung, or blocked in a collective whose peer is gone: the ranks
a launcher signals when it tears down a failed job) would be killed only after the launcher's grace,
30 s under torchrun, delaying the restart. With the watchdog on, such a rank exits with 128 + the
signal's number, saying so, `stuck_s` (the watchdog's limit) after the signal; a healthy rank's step
ends well within it. A thread sees the signal through `signal.set_wakeup_fd`, which the C-level
handler writes at once: the Python-level handler would wait for a main thread blocked in C.
"""

from __future__ import annotations

import os
import signal
import socket
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

    def __init__(self, every_s: float, device: torch.device, stuck_s: float = 0.0):
        self.every_s, self.device, self.stuck_s = every_s, device, stuck_s
        self.received = 0  # the first signal's number
        self.last_save = time.monotonic()
        self._previous: dict[int, object] = {}
        self._boundaries = 0  # step boundaries reached (read by the stuck-rank thread)
        self._wakeup: tuple[socket.socket, socket.socket, int] | None = None
        # rank 0 says so, unless a local launcher (`--nproc`, which sets SHIFTLM_SLOTS) already does
        rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        self.announce = rank0 and "SHIFTLM_SLOTS" not in os.environ

    def __enter__(self) -> StepBoundary:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._record)
            if self.stuck_s > 0:
                reader, writer = socket.socketpair()
                writer.setblocking(False)
                previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
                self._wakeup = (reader, writer, previous)
                threading.Thread(
                    target=self._watch, args=(reader,), name="shiftlm-stuck", daemon=True
                ).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._boundaries += 1  # the loop has ended: nothing is stuck
        if self._wakeup is not None:
            reader, writer, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            writer.close()  # ends the thread's read
            self._wakeup = None
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _watch(self, reader: socket.socket) -> None:
        """The first SIGINT/SIGTERM starts the clock: no boundary within `stuck_s`, and the rank exits."""
        with reader:
            while (byte := reader.recv(1)) and byte[0] not in SIGNALS:
                pass
            if not byte:
                return
            seen, deadline = self._boundaries, time.monotonic() + self.stuck_s
            while time.monotonic() < deadline:
                if self._boundaries != seen:
                    return
                time.sleep(0.05)
        name = signal.Signals(byte[0]).name
        message = (
            f"[shiftlm] {name}: no step boundary {self.stuck_s:g} s (monitor.watchdog_s) after the signal: "
            f"this rank is stuck; exiting with {exit_code(byte[0])} without a checkpoint\n"
        )
        os.write(2, message.encode())
        os._exit(exit_code(byte[0]))

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
            self._boundaries += 1
            return self.received, due
        flags = torch.tensor([float(self.received), float(due and dist.get_rank() == 0)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self._boundaries += 1
        return int(flags[0].item()), bool(flags[1].item())
