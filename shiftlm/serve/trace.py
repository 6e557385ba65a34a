"""Request traces for replay: the Azure LLM inference trace (CSV) and a JSONL form, scaled for a CPU.

Azure 2023 (Patel et al., "Splitwise", ISCA 2024): `TIMESTAMP,ContextTokens,GeneratedTokens`, one row
per request. JSONL: one object per line with `timestamp` (ms), `input_length`, `output_length`.
Prompts are not part of either, so replay sends synthetic prompts of the given length and forces the
given output length (ignore_eos + max_tokens).
"""

from __future__ import annotations

import csv
import datetime
import gzip
import io
import json
from dataclasses import dataclass, replace
from pathlib import Path

from shiftlm.data import TRACES, resolve_trace


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds after the first request of the replayed slice
    input_len: int
    output_len: int


def load_trace(path: str | Path) -> list[TraceRequest]:
    """A trace file (`.csv`, `.csv.gz`, `.jsonl`) or a shipped trace's short name (`azure_code`)."""
    path = resolve_trace(path)
    if not path.exists():
        raise FileNotFoundError(
            f"trace {path} does not exist; pass a trace file or one of the shipped traces: {', '.join(TRACES)}"
        )
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        requests = [
            TraceRequest(row["timestamp"] / 1000.0, int(row["input_length"]), int(row["output_length"]))
            for row in rows
        ]
    else:
        with _open_text(path) as handle:
            reader = csv.DictReader(handle)
            missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
            if missing:
                raise ValueError(
                    f"{path} lacks columns {sorted(missing)}; expected the Azure CSV or .jsonl format"
                )
            requests = [
                TraceRequest(
                    _seconds(row["TIMESTAMP"]), int(row["ContextTokens"]), int(row["GeneratedTokens"])
                )
                for row in reader
            ]
    return sorted(requests, key=lambda r: r.arrival)


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", newline="")
    return path.open(newline="")


def _seconds(timestamp: str) -> float:
    # the trace has 7 fractional digits; Python parses at most 6
    head, _, fraction = timestamp.partition(".")
    moment = datetime.datetime.fromisoformat(f"{head}.{(fraction or '0')[:6]:0<6}")
    return moment.timestamp()


def scale_trace(
    requests: list[TraceRequest],
    start: int = 0,
    max_requests: int | None = None,
    time_scale: float = 1.0,
    rate: float | None = None,
    max_input: int | None = None,
    max_output: int | None = None,
) -> list[TraceRequest]:
    """A slice of the trace with arrivals from 0, gaps times `time_scale` (or rescaled to `rate`
    requests/s on average), and lengths clipped to [1, max]."""
    if time_scale <= 0 or (rate is not None and rate <= 0):
        raise ValueError("--time-scale and --rate must be positive")
    for flag, value in (
        ("--max-requests", max_requests),
        ("--max-input", max_input),
        ("--max-output", max_output),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} must be >= 1 (leave it out for no limit)")
    if start < 0:
        raise ValueError(f"--start {start} must be >= 0 (the trace's first row)")
    chosen = requests[start : start + max_requests if max_requests else None]
    if not chosen:
        raise ValueError(f"the trace has no requests from row {start}; lower --start")
    origin = chosen[0].arrival
    span = chosen[-1].arrival - origin
    factor = (len(chosen) - 1) / (span * rate) if rate and span > 0 else time_scale
    return [
        replace(
            r,
            arrival=(r.arrival - origin) * factor,
            input_len=max(1, min(r.input_len, max_input or r.input_len)),
            output_len=max(1, min(r.output_len, max_output or r.output_len)),
        )
        for r in chosen
    ]


def synthetic_prompt(index: int, length: int, first_id: int = 3, alphabet: int = 50) -> list[int]:
    """Deterministic token ids; distinct requests differ from their first token (no accidental prefix hits)."""
    return [first_id + (index * 7 + position * 13) % alphabet for position in range(length)]
