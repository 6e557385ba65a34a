"""`shiftlm monitor report`: straggler and hang analysis of dumped collective ledgers.

shiftlm monitor report runs/train               # a training run's dir (its ledgers/ folder)
shiftlm monitor report runs/x/hang              # ledger-rank*.json written by the watchdog
shiftlm monitor report runs/x/hang --json --min-delay-ms 5
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shiftlm.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    monitor = subparsers.add_parser("monitor", help="straggler and hang analysis of collective ledgers")
    actions = monitor.add_subparsers(dest="monitor_command", metavar="ACTION", required=True)
    report = actions.add_parser("report", help="analyse the ledger-rank*.json files of one job")
    report.add_argument(
        "ledger_dir", metavar="RUN", help="a run's log.dir, or a directory holding ledger-rank*.json"
    )
    report.add_argument("--window", type=int, default=50, help="collectives per rank to judge (default 50)")
    report.add_argument("--min-fraction", type=float, default=0.8, help="straggler: share of times last")
    report.add_argument("--min-delay-ms", type=float, default=10.0, help="straggler: median delay when last")
    report.add_argument("--json", action="store_true", help="print one JSON object")
    report.set_defaults(func=run_report)


def _load(directory: Path):
    from shiftlm.comm.ledger import load_ledger

    if not directory.is_dir():
        raise ValueError(
            f"{directory} is not a directory; pass a run's log.dir or the folder the watchdog dumped into"
        )
    paths = sorted(directory.glob("ledger-rank*.json"))
    if not paths and (directory / "ledgers").is_dir():  # a training run's log.dir
        paths = sorted((directory / "ledgers").glob("ledger-rank*.json"))
    if not paths:
        raise ValueError(
            f"no ledger-rank*.json files in {directory} or its ledgers/; train with --monitor.straggler_every=N > 0 and a world > 1"
        )
    try:
        return [load_ledger(path) for path in paths]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"cannot read the ledgers in {directory} ({err}); were they written by shiftlm?"
        ) from None


def run_report(args: argparse.Namespace) -> int:
    from shiftlm.monitor.straggler import find_stragglers

    try:
        if args.window < 1 or not 0 < args.min_fraction <= 1:
            raise ValueError("--window must be >= 1 and --min-fraction in (0, 1]")
        ledgers = _load(Path(args.ledger_dir))
    except ValueError as err:  # one line, `shiftlm COMMAND: error: ...` (shiftlm.cli.main), exit 2
        raise ConfigError(str(err)) from None
    stragglers = find_stragglers(
        ledgers, window=args.window, min_fraction=args.min_fraction, min_delay_ms=args.min_delay_ms
    )
    hangs = {ledger.rank: ledger.extra["hang"] for ledger in ledgers if "hang" in ledger.extra}
    members = {rank for ledger in ledgers for ranks in ledger.groups.values() for rank in ranks}
    summary = {
        "ranks_with_ledger": sorted(ledger.rank for ledger in ledgers),
        "ranks_without_ledger": sorted(members - {ledger.rank for ledger in ledgers}),
        "records": sum(len(ledger.records) for ledger in ledgers),
        "stragglers": stragglers.to_dict(),
        "hangs": {str(rank): hang for rank, hang in sorted(hangs.items())},
        "hang_root_causes": sorted({r for hang in hangs.values() for r in hang["root_causes"]}),
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(
        f"ledgers of {len(ledgers)} ranks, {summary['records']} records; missing: "
        f"{summary['ranks_without_ledger'] or 'none'}"
    )
    # per rank: collectives it entered, how often it entered last (count, %), the median delay it
    # caused the others when last, and how late it was on average
    print(
        f"{'rank':>4} {'collectives':>11} {'entered last':>12} {'% last':>6} {'median delay ms':>15} "
        f"{'mean lateness ms':>16}"
    )
    for entry in stragglers.ranks:
        print(
            f"{entry.rank:>4} {entry.collectives:>11} {entry.times_last:>12} {100 * entry.last_fraction:>6.0f} "
            f"{entry.median_delay_ms:>15.1f} {entry.mean_lateness_ms:>16.1f}"
        )
    print(stragglers.summary())
    for rank, hang in sorted(hangs.items()):
        print(f"hang seen by rank {rank}: {hang['message']}")
    if hangs:
        print(f"hang root cause: ranks {summary['hang_root_causes']}")
    return 0
