"""Communication-driven reliability (C4, Dong et al. 2024): stragglers and hangs named from the ledger."""

from shiftlm.monitor.faults import Fault, inject, inject_from_env, parse_fault, set_step
from shiftlm.monitor.hang import HangDiagnosis, diagnose
from shiftlm.monitor.straggler import StragglerReport, find_stragglers, gather_ledgers
from shiftlm.monitor.watchdog import HANG_EXIT_CODE, Watchdog, connect_store

__all__ = [
    "HANG_EXIT_CODE",
    "Fault",
    "HangDiagnosis",
    "StragglerReport",
    "Watchdog",
    "connect_store",
    "diagnose",
    "find_stragglers",
    "gather_ledgers",
    "inject",
    "inject_from_env",
    "parse_fault",
    "set_step",
]
