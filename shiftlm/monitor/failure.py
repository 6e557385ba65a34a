"""What a failed rank reports, and the exit codes a supervisor acts on.

torchrun's agent (and `shiftlm train --nproc`'s local launcher, `shiftlm.launch.run_ranks`) restart
a job on any non-zero exit; the code says whether a restart can help (sysexits.h):

    EXIT_USAGE     = 2    bad input (config, data): one line, no traceback; fix it, then rerun
    EXIT_EXCEPTION = 1    a rank raised: its traceback is printed; a restart replays the same bug
    EXIT_TEMPFAIL  = 75   a rank died (signal, OOM kill, exit) or hung, or a peer vanished: restart
    EXIT_EXCLUDED  = 76   a rank was persistently slow and `--elastic` asked to relaunch without it

A rank's failure becomes a `FailureReport` (rank, kind, exit code, message, traceback). The launcher
that started the rank installs a reporter (`set_reporter`) so reports reach it before the process
exits (the hang watchdog reports its diagnosis this way); under torchrun the report is printed and
written to `$TORCHELASTIC_ERROR_FILE`, which the agent shows in its "Root Cause" section.
"""

from __future__ import annotations

import os
import signal
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from shiftlm.errors import EXIT_EXCLUDED, EXIT_TEMPFAIL

EXIT_EXCEPTION = 1
EXIT_USAGE = 2

# kinds, most telling first: the root cause of a failed job is the report of the lowest rank here
KINDS = ("usage", "exception", "died", "hang", "straggler", "peer")
EXIT_CODES = {
    "usage": EXIT_USAGE,
    "exception": EXIT_EXCEPTION,
    "died": EXIT_TEMPFAIL,
    "hang": EXIT_TEMPFAIL,
    "straggler": EXIT_EXCLUDED,
    "peer": EXIT_TEMPFAIL,
}
_PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "nccl",
    "gloo",
    "timed out",
    "connection refused",
)


@dataclass
class FailureReport:
    rank: int
    kind: str  # one of KINDS
    message: str  # one line
    traceback: str = ""
    culprits: list[int] = field(default_factory=list)  # ranks to blame (a hang's root causes, a straggler)
    code: int | None = None  # overrides the kind's exit code (a user error's own, e.g. 3)

    @property
    def exit_code(self) -> int:
        return self.code if self.code is not None else EXIT_CODES[self.kind]

    def to_dict(self) -> dict:
        return asdict(self)


class ExcludeRank(RuntimeError):
    """Raised on every rank when the straggler watch asks `--elastic` to relaunch without `rank`."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


def describe_coords(parallel, rank: int) -> str:
    """`dp1 pp0 sp0 tp1` for `rank` under a layout with dp/pp/sp/tp sizes (mesh rank order)."""
    from shiftlm.mesh import coords_of

    coords = coords_of(parallel, rank)
    return f"dp{coords.dp} pp{coords.pp} sp{coords.sp} tp{coords.tp}"


def is_peer_loss(err: BaseException) -> bool:
    """A communication error: the backend lost a peer (it died, or its socket closed)."""
    try:
        import torch.distributed as dist

        if isinstance(err, dist.DistBackendError | dist.DistNetworkError):
            return True
    except (ImportError, AttributeError):
        pass
    text = str(err).lower()
    return isinstance(err, RuntimeError | ConnectionError | OSError) and any(s in text for s in _PEER_LOST)


def report_exception(
    rank: int, err: BaseException, usage: tuple[type[BaseException], ...] = ()
) -> FailureReport:
    """The report of an exception raised on `rank` (`usage`: the classes that mean bad input)."""
    trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    line = f"{type(err).__name__}: {err}".splitlines()[0] if str(err) else type(err).__name__
    if usage and isinstance(err, usage):
        return FailureReport(rank, "usage", str(err), code=getattr(err, "exit_code", EXIT_USAGE))
    if isinstance(err, ExcludeRank):
        return FailureReport(rank, "straggler", str(err), "", [err.rank])
    if is_peer_loss(err):
        return FailureReport(rank, "peer", f"lost a peer: {line}", trace)
    return FailureReport(rank, "exception", line, trace, [rank])


def report_exit(rank: int, exitcode: int | None) -> FailureReport:
    """The report of a process that ended without saying why (killed, or exited early)."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        how = f"killed by {name}"
    else:
        how = f"exited with code {exitcode} before finishing"
    return FailureReport(rank, "died", f"process {how}", "", [rank])


_reporter: Callable[[FailureReport], None] | None = None


def set_reporter(reporter: Callable[[FailureReport], None] | None) -> None:
    """Where `report` sends this process's failure (the local launcher's pipe); None: nowhere."""
    global _reporter
    _reporter = reporter


def report(failure: FailureReport) -> None:
    """Hand `failure` to the launcher (if one listens) and to torchrun's error file (if set)."""
    if _reporter is not None:
        try:
            _reporter(failure)
        except (OSError, ValueError):  # the launcher is gone: nothing to tell
            pass
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and not os.path.exists(error_file):
        import json
        import time

        body = {
            "message": {
                "message": f"{failure.kind}: {failure.message}",
                "extraInfo": {"py_callstack": failure.traceback, "timestamp": str(int(time.time()))},
            }
        }
        try:
            with open(error_file, "w") as handle:
                json.dump(body, handle)
        except OSError:
            pass
