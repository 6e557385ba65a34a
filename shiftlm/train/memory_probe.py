"""The trainer's measured memory peak: every byte the c10 CPU allocator hands out and takes back
while a `Trainer` is built and runs `steps` steps (torch.profiler's memory events), so the simulator's
per-rank model (`shiftlm.sim.trainer_costs.trainer_memory`) can be checked against it.

Allocation accounting, not RSS: it counts tensors (parameters, gradients, moments, masks, saved
activations, collective outputs, temporaries, ZeRO-3's gathered units, whose storages are resized
through the allocator) and leaves out what the model does not claim to cover: the Python and torch
runtime, gloo's own buffers and malloc's fragmentation (RSS has them; it also counts calloc'ed zero
pages only once touched, which made it drift by tens of MB between identical runs here).
"""

from __future__ import annotations

import json
import tempfile

MIB = 2**20


def allocation_peak(overrides: list[str], log_dir: str, steps: int = 2) -> dict:
    """Build a trainer from `overrides` on this rank and run `steps` steps (no checkpoint) under the
    profiler; returns this rank's peak and final live bytes, and the model's estimate for it."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from shiftlm.train.config import load_config
    from shiftlm.train.preflight import estimate
    from shiftlm.train.setup import model_shape
    from shiftlm.train.trainer import Trainer

    fixed = ["--checkpoint.resume=false", "--checkpoint.overwrite=true", "--log.progress=off"]
    config = load_config(None, [*overrides, *fixed, f"--log.dir={log_dir}", f"--train.steps={steps + 1}"])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        Trainer(config, quiet=True).run(stop_after=steps)
    events = profiled_events(prof)
    live = peak = 0
    for event in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        live += event["args"]["Bytes"]
        peak = max(peak, live)
    model = estimate(config, model_shape(config), config.parallel.world_size)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return {"rank": rank, "peak_bytes": peak, "end_bytes": live, "model_bytes": model["tensor_bytes"]}


def profiled_events(prof) -> list[dict]:
    """The chrome-trace events of a finished `torch.profiler.profile`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        return json.load(open(trace.name))["traceEvents"]


def tagged_peak(events: list[dict], tag: str, after: str | None = None) -> int:
    """Peak live bytes of the allocations made inside `record_function(tag)` ranges (matched by the
    allocation's thread and time), each live until the allocator frees its address: e.g. the
    gradient storage (`flat.GRADS_TAG`: the flat gradient buffer, or the gradient shard and the
    transient unit buffers of ZeRO-2/3). `after`: the peak counts from the start of the first range of
    that name on (what was allocated before stays live)."""
    ranges: dict = {}
    for event in events:
        if event.get("name") == tag and event.get("ph") == "X":
            ranges.setdefault(event.get("tid"), []).append((event["ts"], event["ts"] + event["dur"]))
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    start = min((e["ts"] for e in events if e.get("name") == after and e.get("ph") == "X"), default=None)
    if after is not None and start is None:
        raise ValueError(f"no profiler range named {after!r} in the trace")
    live: dict[int, int] = {}
    current = peak = 0
    for event in memory:
        nbytes, address = event["args"]["Bytes"], event["args"].get("Addr")
        if nbytes > 0 and any(a <= event["ts"] <= b for a, b in ranges.get(event.get("tid"), ())):
            live[address] = nbytes
            current += nbytes
        elif nbytes < 0 and address in live:
            current -= live.pop(address)
        if start is None or event["ts"] >= start:
            peak = max(peak, current)
    return peak


def compare(per_rank: list[dict]) -> dict:
    """The model (the busiest rank) against the largest measured peak of the ranks."""
    measured = max(r["peak_bytes"] for r in per_rank)
    model = per_rank[0]["model_bytes"]
    return {
        "measured_mib": round(measured / MIB, 1),
        "model_mib": round(model / MIB, 1),
        "error": round(model / measured - 1, 4),
        "ranks_mib": [round(r["peak_bytes"] / MIB, 1) for r in per_rank],
    }
