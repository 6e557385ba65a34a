"""`shiftlm monitor report` over dumped ledgers, and the fault spec parser."""

import json

import pytest

from shiftlm.cli import main
from shiftlm.comm import RankLedger, Record
from shiftlm.monitor.faults import Fault, parse_fault


def _dump_two_ranks(directory, slow_rank):
    records = {0: [], 1: []}
    for seq in range(20):
        for rank in (0, 1):
            enter = seq + (0.05 if rank == slow_rank else 0.001 * rank)
            records[rank].append(Record("all_reduce", "dp", 16, seq, enter, seq + 0.06))
    for rank in (0, 1):
        RankLedger(rank, {"dp": (0, 1)}, records[rank]).dump(directory)


def test_report_names_the_slow_rank_in_json(tmp_path, capsys):
    _dump_two_ranks(tmp_path, slow_rank=1)
    assert main(["monitor", "report", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["stragglers"]["culprits"] == [1]
    assert summary["ranks_without_ledger"] == [] and summary["hang_root_causes"] == []


def test_report_on_an_empty_directory_is_a_one_line_error(tmp_path, capsys):
    assert main(["monitor", "report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shiftlm monitor: error: no ledger-rank*.json") and err.count("\n") == 1


def test_fault_specs_parse_and_bad_ones_say_what_is_wrong():
    assert parse_fault("slow:rank=1,ms=50") == Fault("slow", 1, 0, 50.0)
    assert parse_fault("hang:rank=3,step=5") == Fault("hang", 3, 5)
    for bad, message in [
        ("slow:rank=1", "ms > 0"),
        ("nap:rank=1", "one of"),
        ("hang:step=2", "rank=N"),
        ("hang:rank=x", "wants a number"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_fault(bad)
