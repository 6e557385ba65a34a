"""Fault injection for tests and drills: make one rank slow, hung or dead from a chosen step.

The fault runs as a ledger hook, i.e. just before the rank enters a communication op, so to the
other ranks it looks exactly like a rank whose compute is slow (it enters late), hung (it never
enters) or gone (it exited). Faults fire on every op from `step` on; the step is whatever the
training loop last passed to `set_step` (0 until then).

    SHIFTLM_FAULT="slow:rank=1,ms=50"         rank 1 sleeps 50 ms before every op
    SHIFTLM_FAULT="hang:rank=3,step=5"        rank 3 blocks forever at its first op of step 5
    SHIFTLM_FAULT="exit:rank=3,step=5"        rank 3 exits (code 1) at its first op of step 5
    SHIFTLM_FAULT="kill:rank=3,step=5"        rank 3 sends itself SIGKILL (kill -9) at step 5
    SHIFTLM_FAULT="raise:rank=3,step=5"       rank 3 raises InjectedFault at its first op of step 5
    SHIFTLM_FAULT="hang:rank=1,step=3,attempt=0"   only in torchrun's first attempt (a restart drill)

`rank` names a launch slot: the rank in the job's first attempt. After `shiftlm train --elastic`
relaunched without some ranks, `$SHIFTLM_SLOTS` maps each new rank to its slot, so the fault stays
with the (simulated) host it was put on, and is gone once that host is excluded.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from shiftlm.comm.group import CommGroup
from shiftlm.comm.ledger import CollectiveLedger, ledger

KINDS = ("slow", "hang", "exit", "kill", "raise")
ENV_VAR = "SHIFTLM_FAULT"
_current_step = 0


def set_step(step: int) -> None:
    """Tell the fault injector which training step is running (the trainer calls this each step)."""
    global _current_step
    _current_step = step


class InjectedFault(RuntimeError):
    """What a `raise` fault raises: an ordinary exception in one rank's training step."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int = 0
    ms: float = 0.0  # the delay of a "slow" fault
    attempt: int | None = None  # fire only in this torchrun attempt ($TORCHELASTIC_RESTART_COUNT)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "slow" and self.ms <= 0:
            raise ValueError("a slow fault needs ms > 0, e.g. slow:rank=1,ms=50")

    def __call__(self, op: str, group: CommGroup) -> None:
        if slot_of(group.global_rank) != self.rank or _current_step < self.step:
            return
        if (
            self.attempt is not None
            and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != self.attempt
        ):
            return
        if self.kind == "slow":
            time.sleep(self.ms / 1e3)
        elif self.kind == "hang":
            while True:  # alive (its watchdog keeps publishing) but never enters again
                time.sleep(3600)
        elif self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "raise":
            raise InjectedFault(f"injected fault on rank {self.rank} before {op} on {group.name}")
        else:
            print(f"[shiftlm.monitor.faults] rank {self.rank} exits before {op} on {group}", file=sys.stderr)
            os._exit(1)


def slot_of(rank: int) -> int:
    """The launch slot of `rank` ($SHIFTLM_SLOTS, set by the elastic launcher; else the rank)."""
    slots = os.environ.get("SHIFTLM_SLOTS")
    if not slots:
        return rank
    table = [int(s) for s in slots.split(",")]
    return table[rank] if rank < len(table) else rank


def parse_fault(text: str) -> Fault:
    """`kind:key=value,...` (keys: rank, step, ms, attempt) -> Fault; ValueError says what is wrong."""
    kind, _, rest = text.partition(":")
    fields: dict[str, float] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in ("rank", "step", "ms", "attempt"):
            raise ValueError(f"unknown fault field {key!r} in {text!r} (use rank, step, ms, attempt)")
        try:
            fields[key] = float(value)
        except ValueError:
            raise ValueError(f"fault field {key} wants a number, got {value!r} in {text!r}") from None
    if "rank" not in fields:
        raise ValueError(f"a fault needs rank=N, got {text!r}")
    attempt = int(fields["attempt"]) if "attempt" in fields else None
    return Fault(
        kind.strip(), int(fields["rank"]), int(fields.get("step", 0)), fields.get("ms", 0.0), attempt
    )


def inject(fault: Fault, target: CollectiveLedger = ledger) -> Fault:
    """Install `fault` (it acts only on its own rank); returns it, for `remove`."""
    target.hooks.append(fault)
    return fault


def remove(fault: Fault, target: CollectiveLedger = ledger) -> None:
    target.hooks.remove(fault)


def inject_from_env(target: CollectiveLedger = ledger) -> Fault | None:
    """Install the fault described by $SHIFTLM_FAULT, if set."""
    text = os.environ.get(ENV_VAR)
    return inject(parse_fault(text), target) if text else None
