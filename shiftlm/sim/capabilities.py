"""What shiftlm's trainer and server implement today: the planners propose nothing else.

A plan is only useful if `shiftlm train --config plan.toml` (or `shiftlm serve`) runs it, so the
planners read their choices from these constants, and tests/sim/test_plans_run.py round-trips their
top plans through the trainer's `load_config` and `check_layout`. When the trainer gains a feature,
enabling it in the planner is one line here (and the test keeps the two honest).
"""

from __future__ import annotations

from shiftlm.train.config import ZERO_STAGES

# ZeRO stages `train.zero` accepts: read from the trainer's own table (one place, torch-free module),
# so a stage the trainer implements is one the planner may propose, and nothing else.
TRAINER_ZERO_STAGES: tuple[int, ...] = tuple(ZERO_STAGES)

# Megatron sequence parallelism (norms and residuals split over TP, Korthikanti et al. 2022): the model
# implements it (`ParallelConfig.sequence_parallel`), but the trainer's [parallel] section has no key
# for it, so a planned layout runs without it and is priced without it.
TRAINER_MEGATRON_SEQUENCE_PARALLEL = False

# `shiftlm serve` runs one engine over sp x tp ranks; it has no --dp (independent replicas behind
# one API), so `plan serve` proposes one replica only.
SERVE_DATA_PARALLEL = False


def planned_zero_stages(
    dp: int, implemented: tuple[int, ...] = TRAINER_ZERO_STAGES, pp: int = 1
) -> tuple[int, ...]:
    """The ZeRO stages worth planning for a layout with `dp` replicas: 0 without DP; with DP the
    highest of stages 1-2 (ZeRO-1 and -2 move the same bytes as an all-reduce, so the higher one only
    saves memory; Rajbhandari et al. 2020, Sec. 7) and ZeRO-3 (1.5x the traffic for less memory).

    ZeRO-3 is planned without a pipeline only: under one the trainer re-gathers every layer for every
    micro-batch (train/zero3.py), traffic the cost model prices once per step, so such a plan would
    run but slower than predicted."""
    if dp == 1:
        return (0,)
    stages = [max(s for s in implemented if s <= 2)]
    if 3 in implemented and pp == 1:
        stages.append(3)
    return tuple(stages)
