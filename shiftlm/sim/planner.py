"""Find the fastest training layout that fits: enumerate, bound, simulate only what can still win.

Every layout (dp, pp, sp, tp, ep for a mixture of experts, micro-batch, schedule, recompute, ZeRO) is enumerated and given a
lower bound on its memory (one micro-batch in flight) and on its step time (`step_time_bound`: no
rank finishes before the forward chain reaches its first stage and it has done all its own work).
Candidates are then simulated in order of their bound, with the real schedule; the search stops once
the next bound is no faster than the k-th best simulated layout, so the result is exactly the top k
a full search would find. Simulations are memoised on normalised costs (`pipeline_timing.pipeline_timing`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError
from shiftlm.hardware import DTYPE_BYTES, Hardware
from shiftlm.parallel import ParallelConfig
from shiftlm.pipeline.schedules import SCHEDULES
from shiftlm.sim.capabilities import (
    TRAINER_EXPERT_TP,
    TRAINER_MEGATRON_SEQUENCE_PARALLEL,
    planned_zero_stages,
)
from shiftlm.sim.efficiency import FIRST_PRINCIPLES, Efficiency
from shiftlm.sim.layout import Layout
from shiftlm.sim.pipeline_timing import StageCosts
from shiftlm.sim.train import (
    StepResult,
    simulate_step,
    stage_costs,
    step_overheads,
    trainer_split,
)
from shiftlm.sim.trainer_costs import (
    regathered_stage_costs,
    trainer_memory,
    trainer_pointwise_bytes,
    trainer_step_memory,
)

# Dominated choices are not enumerated: zb_h1 keeps 1F1B's activations with a smaller bubble and
# zb_v interleaved's two chunks with 1F1B's memory (Qi et al. 2023/2024), where every block runs
# alike; with compiled blocks the zero-bubble schedules' split micro-batches run eagerly
# (`sim.train.trainer_split`), so 1F1B and interleaved 1F1B are planned too; every ZeRO stage the
# trainer implements is planned (`planned_zero_stages`), fits as the trainer keeps its states and
# ZeRO-3's per-micro-batch gathers priced (`trainer_costs.py`); with FlashAttention selective
# recompute is free and saves what "none" would. Only what `shiftlm train` runs is proposed
# (`capabilities.py`): e.g. no Megatron sequence parallelism until the trainer has it.
PLANNED_SCHEDULES = ("zb_h1", "zb_v")
COMPILED_SCHEDULES = ("1f1b", "interleaved_1f1b")  # planned beside them where blocks are compiled
MICRO_BATCHES = (1, 2, 4, 8)
PLANNED_RECOMPUTE = ("selective", "full")


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def enumerate_layouts(
    model: ModelConfig,
    gpus: int,
    gpus_per_node: int,
    seq_len: int,
    global_batch: int,
    compiled: bool = True,
) -> Iterator[Layout]:
    """Every layout whose shape is valid: TP inside a node dividing the KV heads (or a multiple of
    them), SP dividing the remaining heads, PP dividing the layers, micro-batches >= PP; the
    schedules that are not dominated with `compiled` blocks or eager ones (PLANNED_SCHEDULES)."""
    for tp in _powers_of_two(min(gpus_per_node, model.num_heads)):
        if model.num_heads % tp or (model.num_kv_heads % tp and tp % model.num_kv_heads):
            continue
        for sp, cp in _sequence_splits(model, gpus, tp, seq_len):
            for pp in range(1, model.num_layers + 1):
                if model.num_layers % pp or gpus % (tp * sp * cp * pp):
                    continue
                dp = gpus // (tp * sp * cp * pp)
                for micro_batch in MICRO_BATCHES:
                    if global_batch % (dp * micro_batch):
                        continue
                    microbatches = global_batch // (dp * micro_batch)
                    for schedule, chunks in _schedules(model, pp, microbatches, compiled):
                        for recompute in PLANNED_RECOMPUTE:
                            for zero in planned_zero_stages(dp * cp * sp, pp=pp):  # ZeRO group: dp_sp
                                for ep, etp in planned_experts(model, dp, cp, sp, tp, seq_len):
                                    yield Layout(
                                        dp=dp,
                                        pp=pp,
                                        tp=tp,
                                        sp=sp,
                                        micro_batch=micro_batch,
                                        global_batch=global_batch,
                                        seq_len=seq_len,
                                        schedule=schedule,
                                        chunks=chunks,
                                        recompute=recompute,
                                        zero=zero,
                                        sequence_parallel=TRAINER_MEGATRON_SEQUENCE_PARALLEL,
                                        cp=cp,
                                        ep=ep,
                                        etp=etp,
                                    )


def planned_experts(
    model: ModelConfig, dp: int, cp: int, sp: int, tp: int, seq_len: int
) -> list[tuple[int, int]]:
    """(ep, etp) pairs to plan: ep in powers of two dividing the experts, with expert TP = TP (etp 0)
    and, where tp > 1 and the trainer runs it (`capabilities.TRAINER_EXPERT_TP`), with each expert
    whole on a rank (etp 1, Megatron-Core's usual choice for many small experts): every pair the
    trainer's own checks accept (`ParallelConfig.check_experts`, `check_sequence`); (1, 0) for a
    dense model."""
    if not model.is_moe:
        return [(1, 0)]
    planned = []
    for etp in (0, 1) if TRAINER_EXPERT_TP and tp > 1 else (0,):
        for ep in _powers_of_two(model.num_experts):
            parallel = ParallelConfig(dp=dp, cp=cp, sp=sp, tp=tp, ep=ep, etp=etp)
            try:
                parallel.check_experts(model)
                parallel.check_sequence(seq_len)
            except ConfigError:
                continue
            planned.append((ep, etp))
    return planned


# ring attention hides a K/V transfer behind one c x 2c block; below this many tokens per zigzag
# chunk the blocks are too small to hide anything, so such cp degrees are not planned
MIN_CP_CHUNK_TOKENS = 1024


def _sequence_splits(model: ModelConfig, gpus: int, tp: int, seq_len: int) -> Iterator[tuple[int, int]]:
    """(sp, cp) pairs: Ulysses SP dividing the heads left after TP; context parallelism (ring
    attention, no head limit) in powers of two whose zigzag chunks keep >= MIN_CP_CHUNK_TOKENS."""
    for sp in _powers_of_two(model.num_heads // tp):
        if model.num_heads % (tp * sp) or seq_len % sp or gpus % (tp * sp):
            continue
        for cp in _powers_of_two(gpus // (tp * sp)):
            chunk = seq_len / (2 * cp * sp)
            if cp > 1 and (seq_len % (2 * cp * sp) or chunk < MIN_CP_CHUNK_TOKENS):
                continue
            yield sp, cp


def _schedules(model: ModelConfig, pp: int, microbatches: int, compiled: bool) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield "none", 1
        return
    if microbatches < pp:
        return
    for name in PLANNED_SCHEDULES + (COMPILED_SCHEDULES if compiled else ()):
        chunks = SCHEDULES[name].default_chunks
        if model.num_layers % (pp * chunks) == 0:
            yield name, chunks


def step_time_bound(layout: Layout, stage: StageCosts) -> float:
    """A makespan no schedule can beat: every rank r runs all of its stage-chunks' F + I + W for every
    micro-batch, and cannot start before micro-batch 0's forward has crossed the stages (and the
    rank-to-rank messages) in front of its earliest stage. Admissible for any action order."""
    from shiftlm.pipeline.actions import Placement

    work = [f + i + w for f, i, w in zip(stage.forward, stage.backward_input, stage.backward_weight)]
    if layout.pp == 1:
        return layout.microbatches * work[0]
    placement = Placement(SCHEDULES[layout.schedule].placement, layout.pp, layout.chunks)
    bound = 0.0
    for rank in range(layout.pp):
        held = placement.stages_of(rank)
        busy = layout.microbatches * sum(work[s] for s, _ in held)
        head = min(_forward_chain(placement, stage, s, replica) for s, replica in held)
        bound = max(bound, head + busy)
    return bound


def _forward_chain(placement, stage: StageCosts, target: int, replica: int) -> float:
    """Earliest start of any forward of stage `target`: the forwards of the stages before it plus
    one message per rank boundary crossed."""
    hops = sum(placement.rank_of(s, replica) != placement.rank_of(s + 1, replica) for s in range(target))
    return sum(stage.forward[:target]) + hops * stage.p2p


@dataclass
class Ranked:
    layout: Layout
    result: StepResult

    def why(self) -> str:
        """The terms that decide this layout's rank, as shares of its step time."""
        parts = self.result.breakdown
        step = self.result.step_time
        shares = ", ".join(f"{name} {100 * value / step:.0f}%" for name, value in parts.items() if value > 0)
        memory = self.result.memory
        return f"{shares}; {memory.total / 2**30:.0f} of {memory.capacity / 2**30:.0f} GiB"


@dataclass
class Plan:
    ranked: list[Ranked]
    enumerated: int
    fit_lower_bound: int
    simulated: int


def plan_training(
    model: ModelConfig,
    hardware: Hardware,
    gpus: int,
    seq_len: int,
    global_batch: int,
    top_k: int = 5,
    efficiency: Efficiency = FIRST_PRINCIPLES,
    dtype: str = "bf16",
    compiled: bool = True,
    eager_efficiency: Efficiency | None = None,
) -> Plan:
    """The `top_k` fastest layouts that fit in memory, best first, with `compiled` decoder blocks
    (`train.compile`) or eager ones (their unfused pointwise traffic: `trainer_pointwise_bytes`);
    compiled, a zero-bubble schedule's split micro-batches run eagerly (`eager_efficiency`, else
    `efficiency`: `sim.train.trainer_split`)."""
    width = DTYPE_BYTES[dtype]
    pointwise = trainer_pointwise_bytes(model, width, compiled)
    split = trainer_split(model, width, compiled, eager_efficiency or efficiency)
    bounds: list[tuple[float, Layout]] = []
    stage_memo: dict[tuple, StageCosts] = {}
    enumerated = 0
    for layout in enumerate_layouts(model, gpus, hardware.gpus_per_node, seq_len, global_batch, compiled):
        enumerated += 1
        if not trainer_memory(model, layout, 1, hardware.hbm_bytes, width).fits:
            continue
        # stage costs depend on the shape of one model replica's work only, not on dp or ZeRO
        key = (
            layout.tp,
            layout.sp,
            layout.cp,
            layout.pp,
            layout.chunks,
            layout.micro_batch,
            layout.recompute,
            layout.ep,
            layout.expert_tp,
            layout.dp if layout.experts_apart else 0,  # where an ep group lies depends on dp
        )
        if key not in stage_memo:
            stage_memo[key] = stage_costs(
                model, layout, hardware, efficiency, dtype, layout.pp * layout.chunks
            )
        stage = regathered_stage_costs(stage_memo[key], model, layout, hardware, efficiency)
        exposed_sync, optimizer = step_overheads(model, layout, hardware, efficiency, dtype, stage)
        bounds.append((step_time_bound(layout, stage) + exposed_sync + optimizer, layout))
    bounds.sort(key=lambda item: item[0])

    ranked: list[Ranked] = []
    simulated = 0
    for bound, layout in bounds:
        if len(ranked) >= top_k and bound >= ranked[-1].result.step_time:
            break
        # the bound leaves the pointwise traffic out, which only lengthens a step: still a bound
        layout = replace(layout, pointwise_bytes=pointwise)
        result = simulate_step(model, layout, hardware, efficiency, dtype, split)
        simulated += 1
        # fits as the trainer keeps its states (fp32, full gradient buffer: trainer_costs)
        result = replace(result, memory=trainer_step_memory(model, layout, hardware.hbm_bytes, width))
        if not result.memory.fits:
            continue
        ranked.append(Ranked(layout, result))
        ranked.sort(key=lambda r: r.result.step_time)
        del ranked[top_k:]
    return Plan(ranked, enumerated, len(bounds), simulated)


def train_config_toml(model_name: str, layout: Layout, compiled: bool | None = None) -> str:
    """The `shiftlm train` config for `layout` (schema agreed with the trainer); `compiled`, where
    given, as `train.compile` (None: the trainer's default, auto)."""
    schedule = layout.schedule if layout.pp > 1 else "1f1b"
    return (
        f'[model]\nname = "{model_name}"\n\n'
        f"[parallel]\ndp = {layout.dp}\npp = {layout.pp}\nsp = {layout.sp}\ntp = {layout.tp}\n"
        + (f"cp = {layout.cp}\n" if layout.cp > 1 else "")
        + (f"ep = {layout.ep}\n" if layout.ep > 1 else "")
        + (f"etp = {layout.expert_tp}\n" if layout.expert_tp != layout.tp else "")
        + "\n"
        f"[train]\nmicro_batch = {layout.micro_batch}\nglobal_batch = {layout.global_batch}\n"
        f'seq_len = {layout.seq_len}\nschedule = "{schedule}"\nchunks = {layout.chunks}\n'
        f'recompute = "{layout.recompute}"\nzero = {layout.zero}\n'
        + ("" if compiled is None else f"compile = {str(compiled).lower()}\n")
    )
