"""Hang detection: the watchdog names the rank that never entered, dumps the ledger, exits 75."""

import datetime
import json
import multiprocessing as mp
import os

import torch
import torch.distributed as dist

from shiftlm.comm import Record
from shiftlm.launch import free_port
from shiftlm.monitor.hang import diagnose, pending_op
from shiftlm.monitor.watchdog import HANG_EXIT_CODE

JOB_DEADLINE_S = 60.0  # the parent kills whatever is left by then: no test can hang


def _hang_job(rank: int, world_size: int, port: int, dump_dir: str, fault: str) -> None:
    """One rank of a TP x DP = 2 x 2 job; the store is hosted by the parent, as torchrun's agent does."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))  # well above the watchdog's

    from shiftlm.comm import all_reduce
    from shiftlm.mesh import Mesh
    from shiftlm.monitor import faults
    from shiftlm.monitor.watchdog import Watchdog, connect_store
    from shiftlm.parallel import ParallelConfig

    mesh = Mesh(ParallelConfig(dp=2, tp=2))
    faults.inject(faults.parse_fault(fault))
    Watchdog(connect_store(), rank, world_size, timeout_s=2.0, interval_s=0.25, dump_dir=dump_dir).start()
    for step in range(6):
        faults.set_step(step)
        all_reduce(torch.ones(4), mesh.tp)
        all_reduce(torch.ones(4), mesh.dp)
    os._exit(0)  # not reached while the fault holds a rank


def _run_job(world_size: int, dump_dir: str, fault: str) -> list[int | None]:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_hang_job, args=(r, world_size, port, dump_dir, fault)) for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=JOB_DEADLINE_S)
    try:
        for proc in procs[:-1]:  # the last rank is the faulty one in these tests: it never finishes
            proc.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        del store
    return [proc.exitcode for proc in procs]


def test_the_watchdog_names_a_hung_rank_on_every_other_rank(tmp_path):
    exit_codes = _run_job(4, str(tmp_path), "hang:rank=3,step=3")
    assert exit_codes[:3] == [HANG_EXIT_CODE] * 3
    dumps = {r: json.loads((tmp_path / f"ledger-rank{r}.json").read_text()) for r in range(3)}
    assert not (tmp_path / "ledger-rank3.json").exists()  # rank 3 hangs outside any op: no timeout there
    for dump in dumps.values():
        assert dump["hang"]["root_causes"] == [3]
    # rank 2 waits in the TP all-reduce #3 of its pair; rank 1 in the DP all-reduce it shares with 3
    assert dumps[2]["hang"]["message"].startswith("rank 3 never entered all_reduce #3 on group tp[2, 3]")
    assert list(dumps[1]["hang"]["missing"]) == ["3"]
    assert "alive, not in a communication op" in dumps[1]["hang"]["missing"]["3"]
    # rank 0 waits on rank 2 (DP), which waits on rank 3: the chain is followed to the root cause
    assert list(dumps[0]["hang"]["missing"]) == ["2"]
    assert "waiting in all_reduce #3 on group tp[2, 3]" in dumps[0]["hang"]["missing"]["2"]
    pending = [Record.from_row(row) for row in dumps[0]["records"] if row[5] is None]
    assert [(r.op, r.group, r.seq) for r in pending] == [("all_reduce", "dp", 3)]


def _beat(rank, progress, pending=None, time=100.0):
    return {"rank": rank, "time": time, "progress": progress, "pending": pending}


def test_a_rank_whose_heartbeat_stopped_is_called_dead():
    waiting = pending_op(Record("all_reduce", "dp", 4, 7, 90.0), 0, (0, 1))
    beats = {0: _beat(0, {"dp": 8}, waiting), 1: _beat(1, {"dp": 7}, time=80.0)}
    diagnosis = diagnose(waiting, beats, now=100.0, stale_s=3.0)
    assert diagnosis.missing == {1: "dead: no heartbeat for 20.0 s"}
    assert diagnosis.root_causes == [1]
    assert diagnosis.message().endswith("rank 0 waited 10.0 s")


def test_a_receive_waits_on_the_peer_matching_send_count():
    receive = pending_op(Record("recv", "pp", 4, 2, 90.0, peer=1), 0, (0, 1))
    sent_twice = {0: _beat(0, {"recv:pp:1": 3}, receive), 1: _beat(1, {"send:pp:0": 2})}
    sent_thrice = {0: sent_twice[0], 1: _beat(1, {"send:pp:0": 3})}
    assert list(diagnose(receive, sent_twice, 100.0, 3.0).missing) == [1]
    assert diagnose(receive, sent_thrice, 100.0, 3.0).missing == {}
