"""What shiftlm's trainer and server implement today: the planners propose nothing else.

A plan is only useful if `shiftlm train --config plan.toml` (or `shiftlm serve`) runs it, so the
planners read their choices from these constants, and tests/sim/test_plans_run.py round-trips their
top plans through the trainer's `load_config` and `check_layout`. When the trainer gains a feature,
enabling it in the planner is one line here (and the test keeps the two honest).
"""

from __future__ import annotations

from shiftlm.config import ZERO_STAGES

# ZeRO stages `train.zero` accepts: read from the trainer's own table (one place, torch-free module),
# so a stage the trainer implements is one the planner may propose, and nothing else.
TRAINER_ZERO_STAGES: tuple[int, ...] = tuple(ZERO_STAGES)

# Megatron sequence parallelism (norms and residuals split over TP, Korthikanti et al. 2022): the trainer
# runs it (`[parallel] sequence_parallel`), but the planner does not propose it yet (its TOML does not
# write the key), so a planned layout runs without it and is priced without it.
TRAINER_MEGATRON_SEQUENCE_PARALLEL = False

# Expert parallelism: the planner proposes ep (docs/moe.md: folded over dp x cp x sp, experts split
# over tp as the dense MLP is) and, at tp > 1, the experts' own TP `etp` = 1 (each expert whole on a
# rank, ep x edp folded over the stage's tp x dp x cp x sp ranks; the trainer runs it, `[parallel] etp`).
TRAINER_EXPERT_TP = True

# `shiftlm serve` runs one engine over sp x tp ranks; it has no --dp (independent replicas behind
# one API), so `plan serve` proposes one replica only.
SERVE_DATA_PARALLEL = False


def planned_zero_stages(
    dp: int, implemented: tuple[int, ...] = TRAINER_ZERO_STAGES, pp: int = 1
) -> tuple[int, ...]:
    """The ZeRO stages to plan for a data group of `dp` ranks: 0 without one; with one every stage
    the trainer implements, at every pp (the trainer runs ZeRO-2/3 under every schedule: tested at
    dp2 x pp2 in tests/train/test_zero.py). None dominates another as the trainer runs them
    (`sim/trainer_costs.py`): ZeRO-2/3 hold 1/dp of the gradients but reduce-scatter them in every
    micro-batch's backward (A times ZeRO-1's bytes with A micro-batches), ZeRO-3 also saves the
    weights for per-micro-batch gathers; the simulator prices each and the planner keeps the fastest
    that fits. `pp` is accepted for callers of the older form."""
    del pp
    return (0,) if dp == 1 else tuple(implemented)
