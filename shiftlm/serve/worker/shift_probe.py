"""`--shift-threshold auto`: the step size where SP x TP starts to beat full TP, measured at startup.

Shift Parallelism runs a step in full TP when it schedules at most `threshold` tokens and in SP x TP
above (docs/serving.md, "Shift Parallelism"). Which mode is faster for a step of n tokens depends on the
model and the machine: SP x TP moves fewer bytes between ranks (all-to-all of 1/SP of the tokens
rather than all-reduces of all of them) but each rank multiplies its tokens by TP-sharded weights that
are SP times larger than full TP's shard, so it reads SP times the weight bytes for its tokens. On this
project's 2-core CPU host, with bench/vs_vllm.py's 4-layer 512-wide model at sp=2, SP x TP was slower
than full TP at every step size up to the 256-token budget (docs/serving.md has the probe's numbers);
with long prefills on GPUs the Shift Parallelism paper finds the opposite. So the server measures it at
startup, as vLLM measures its KV-cache budget.

`measure_shift_threshold` runs synthetic steps through the real runner (every rank executes them, as
it would a request's) before the engine starts: for each probe size, a step of decode rows over a short
context plus one prefill chunk, in both modes alternately, the median of each kept. The threshold is
the largest probe size below the first one where SP x TP wins by more than `margin`, in the first
timing and again in a second one of that size (a single median of a few steps on a shared host can
be off by 10%: a one-off win that would run every larger step in SP x TP is not adopted); when it
never does, every step runs full TP (the threshold is the step budget). The KV blocks the probe writes are
free ones (no request has arrived yet) and every sequence's first chunk rewrites its own.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

from shiftlm.serve.plan import Mode, ScheduledChunk, StepPlan

log = logging.getLogger(__name__)

PROBE_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)
DECODE_ROWS = 32  # decode rows of a probe step (fewer in small steps): the load Shift switches under


def probe_plan(tokens: int, mode: Mode, block_size: int, num_blocks: int) -> StepPlan | None:
    """A step of `tokens` tokens: min(DECODE_ROWS, tokens // 2) decode rows, each one token after a
    context of 3 blocks, and one prefill chunk of the rest; None when the cache has too few blocks."""
    rows = min(DECODE_ROWS, tokens // 2)
    context = 3 * block_size - 1  # its next token fills the third block
    per_row = context // block_size + 1
    prefill = tokens - rows
    needed = rows * per_row + prefill // block_size + 1
    if needed > num_blocks:
        return None
    chunks = [
        ScheduledChunk(i, (5,), context, tuple(range(i * per_row, (i + 1) * per_row)), True, row=i)
        for i in range(rows)
    ]
    first = rows * per_row
    blocks = tuple(range(first, first + prefill // block_size + 1))
    chunks.append(ScheduledChunk(rows, (7,) * prefill, 0, blocks, True, row=rows))
    return StepPlan(0, mode, tuple(chunks))


def measure_shift_threshold(
    execute: Callable[[StepPlan], object],
    max_tokens_per_step: int,
    block_size: int,
    num_blocks: int,
    reps: int = 7,
    budget_s: float = 3.0,
    margin: float = 0.03,
) -> tuple[int, list[dict]]:
    """(threshold, per-size medians) from timing `execute(plan)` (a runner's, which returns once the
    step's logits are on the host) for each probe size up to the step budget, both modes alternating.
    Sizes past `budget_s` seconds of probing, or past what the cache holds, are not probed."""
    sizes = sorted({size for size in PROBE_SIZES if size < max_tokens_per_step} | {max_tokens_per_step})
    rows: list[dict] = []
    deadline = time.perf_counter() + budget_s

    def medians(plans: dict) -> tuple[float, float]:
        times: dict[Mode, list[float]] = {Mode.TP: [], Mode.SP_TP: []}
        for rep in range(reps):
            order = (Mode.TP, Mode.SP_TP) if rep % 2 == 0 else (Mode.SP_TP, Mode.TP)
            for mode in order:
                start = time.perf_counter()
                execute(plans[mode])
                times[mode].append(time.perf_counter() - start)
        return 1e3 * statistics.median(times[Mode.TP]), 1e3 * statistics.median(times[Mode.SP_TP])

    threshold = max_tokens_per_step  # SP x TP never wins: every step full TP
    for size in sizes:
        plans = {mode: probe_plan(size, mode, block_size, num_blocks) for mode in (Mode.TP, Mode.SP_TP)}
        if plans[Mode.TP] is None or (rows and time.perf_counter() > deadline):
            break
        for mode in plans:  # warm-up (first-use weight packing, allocator)
            execute(plans[mode])
        tp_ms, sp_tp_ms = medians(plans)
        rows.append({"tokens": size, "tp_ms": tp_ms, "sp_tp_ms": sp_tp_ms})
        if threshold == max_tokens_per_step and sp_tp_ms < (1 - margin) * tp_ms:
            again_tp, again_sp_tp = medians(plans)  # a win is timed twice before it is adopted
            rows[-1].update(confirm_tp_ms=again_tp, confirm_sp_tp_ms=again_sp_tp)
            if again_sp_tp < (1 - margin) * again_tp:
                threshold = rows[-2]["tokens"] if len(rows) > 1 else 0
    ratios = ", ".join(
        f"{r['tokens']}: {r['sp_tp_ms'] / r['tp_ms']:.2f}"
        + (f" then {r['confirm_sp_tp_ms'] / r['confirm_tp_ms']:.2f}" if "confirm_tp_ms" in r else "")
        for r in rows
    )
    if threshold >= max_tokens_per_step:
        log.info(
            "shift threshold auto: SP x TP was not faster than full TP at any probed step size here "
            "(SP/TP time by tokens %s): every step runs full TP",
            ratios,
        )
    else:
        log.info(
            "shift threshold auto: %d tokens (SP/TP time by tokens %s); --shift-threshold N sets one",
            threshold,
            ratios,
        )
    return threshold, rows
