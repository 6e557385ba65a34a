"""The live straggler rule: a rank is named only when it is last by a margin that is large in absolute
terms *and* against the step time, in several consecutive windows (no false alarms under load)."""

from __future__ import annotations

import json
import random
import re

from shiftlm.comm import RankLedger, Record
from shiftlm.monitor.live import StragglerWatch

GROUP = ("dp", (0, 1))


def _window(slow_rank: int | None, delay_s: float, rng: random.Random, start: float, n: int = 12):
    """Two ranks, `n` all-reduces; every enter jitters by up to 20 ms, `slow_rank` enters `delay_s` late."""
    records = {0: [], 1: []}
    for seq in range(n):
        t = start + seq
        for rank in (0, 1):
            enter = t + rng.uniform(0, 0.02) + (delay_s if rank == slow_rank else 0.0)
            records[rank].append(Record("all_reduce", "dp", 8, seq, enter, t + 0.5))
    return [RankLedger(rank, {"dp": GROUP[1]}, records[rank]) for rank in (0, 1)]


def _watch(tmp_path, persist=3):
    return StragglerWatch(0, 2, every=1, dump_dir=tmp_path, describe=lambda r: f"dp{r}", persist=persist)


def _check(watch, ledgers, step, step_s):
    watch._step_times = [step_s]
    return watch._judge(step, ledgers)


def test_a_rank_late_in_three_windows_running_is_named_with_its_coordinates(tmp_path, capsys):
    watch, rng = _watch(tmp_path), random.Random(0)
    verdicts = [_check(watch, _window(1, 0.05, rng, 100.0 * w), w, 0.5) for w in range(1, 5)]
    assert verdicts[:2] == [None, None]  # suspected, not yet named
    assert verdicts[2][0] == 1 and verdicts[3][0] == 1
    assert re.search(
        r"step 3: rank 1 \(dp1\) slowest in 12/12 collectives, \+(4[5-9]|5[0-5]) ms", capsys.readouterr().err
    )
    named = [json.loads(line)["named"] for line in (tmp_path / "stragglers.jsonl").read_text().splitlines()]
    assert named == [[], [], [1], [1]]
    assert (tmp_path / "ledger-rank1.json").exists()  # for `shiftlm monitor report`


def test_a_late_streak_that_breaks_starts_over(tmp_path):
    watch, rng = _watch(tmp_path), random.Random(1)
    pattern = [1, 1, None, 1, 1]
    verdicts = [_check(watch, _window(s, 0.05, rng, 100.0 * w), w, 0.5) for w, s in enumerate(pattern)]
    assert verdicts == [None] * 5


def test_a_delay_small_against_the_step_time_is_not_named(tmp_path):
    """50 ms late clears the 10 ms floor, but on 4 s steps it is ~1%: below the 3% relative margin."""
    watch, rng = _watch(tmp_path, persist=1), random.Random(2)
    assert _check(watch, _window(1, 0.05, rng, 0.0), 1, 4.0) is None
    assert _check(watch, _window(1, 0.05, rng, 100.0), 2, 0.5)[0] == 1


def test_jitter_alone_names_no_one(tmp_path):
    watch, rng = _watch(tmp_path, persist=1), random.Random(3)
    assert all(_check(watch, _window(None, 0.0, rng, 100.0 * w), w, 0.5) is None for w in range(20))
