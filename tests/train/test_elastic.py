"""Elastic shrink: the dp replicas holding a named rank are dropped, the global batch is kept."""

from __future__ import annotations

from shiftlm.monitor.failure import report_exception, report_exit
from shiftlm.train.config import load_config
from shiftlm.train.elastic import _kept_slots, shrink


def test_shrinking_drops_the_replica_of_the_named_rank_and_keeps_the_global_batch():
    config = load_config(None, ["--parallel.dp=3", "--parallel.tp=2", "--train.global_batch=12"])
    smaller = shrink(config, [3])  # rank 3 is dp1 tp1
    assert smaller.parallel.dp == 2 and smaller.parallel.tp == 2
    assert (config.accumulation, smaller.accumulation, smaller.train.global_batch) == (4, 6, 12)
    assert _kept_slots(config, [3], 2, list(range(6))) == [0, 1, 4, 5]


def test_shrinking_lowers_dp_further_until_the_global_batch_splits_evenly():
    config = load_config(None, ["--parallel.dp=4", "--train.global_batch=8"])
    assert shrink(config, [2]).parallel.dp == 2  # 3 replicas cannot share 8 sequences
    assert shrink(load_config(None, ["--parallel.dp=1"]), [0]) is None


def test_failure_reports_say_whether_a_restart_helps():
    assert report_exit(1, -9).message == "process killed by SIGKILL" and report_exit(1, -9).exit_code == 75
    assert report_exception(0, RuntimeError("Connection closed by peer [127.0.0.1]:5")).kind == "peer"
    try:
        raise ZeroDivisionError("division by zero")
    except ZeroDivisionError as err:
        bug = report_exception(2, err)
    assert (bug.kind, bug.exit_code, bug.culprits) == ("exception", 1, [2])
    assert bug.message == "ZeroDivisionError: division by zero" and "raise ZeroDivisionError" in bug.traceback
