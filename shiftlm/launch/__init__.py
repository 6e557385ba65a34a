"""Run a function on N local gloo ranks (CPU processes), and keep the ranks for the next call.

Tests and `shiftlm verify` use this instead of torchrun: starting a process group costs seconds on a
2-core machine, so a `LocalWorkers` pool initialises torch.distributed once and then runs any number
of module-level functions, in lock-step on every rank. A function that raises on any rank, or takes
longer than `timeout`, fails the call with that rank's traceback instead of hanging.

    with LocalWorkers(4) as workers:
        results = workers.run(my_module.check_layout, tp=2, sp=2)   # one result per rank

`run_ranks` is the other mode, for `shiftlm train --nproc N`: one function, once, on N fresh
processes, supervised as torchrun's agent does: the first rank to fail is named with its own
traceback, the others are stopped within seconds, and the exit code says whether to restart
(`shiftlm.monitor.failure`).
"""

from shiftlm.launch.pools import LocalWorkers, Pools, WorkerError, free_port
from shiftlm.launch.supervise import Interrupted, RankFailure, run_ranks

__all__ = [
    "Interrupted",
    "LocalWorkers",
    "Pools",
    "RankFailure",
    "WorkerError",
    "free_port",
    "run_ranks",
]
