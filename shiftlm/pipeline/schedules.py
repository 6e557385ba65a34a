"""Schedule generators: per-rank compute-action lists for every named schedule.

    build_schedule("1f1b", pp=4, microbatches=8)
    build_schedule("interleaved_1f1b", pp=4, microbatches=8, chunks=2)

Each generator returns, for every rank, the order of its F/B/I/W actions; lowering.py adds the
communication. Requirements are checked in `build_schedule` and broken ones rejected with a message
that says how to fix them. Bubble fractions with T_F = T_I = T_W (what the simulator reproduces):

    gpipe, 1f1b        (p-1) / (m+p-1)            GPipe: Huang et al. 2019; 1F1B: Narayanan et al. 2019
    interleaved_1f1b   (p-1) / (v*m+p-1)          Narayanan et al. 2021, Sec. 2.2
    zb_h1              (p-1) / (3m+p-1)           Qi et al. 2023, Sec. 3.1
    zb_h2, zb_v        no idle time inside any rank's span   Qi et al. 2023, Sec. 3.1 and 6
    bitpipe            see docs/pipeline.md        Wu et al. 2024
    dualpipe_v         see docs/pipeline.md        DeepSeek-V3 (2024), DualPipe's "V" variant
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shiftlm.pipeline.actions import Action, Kind, Placement, PlacementKind, Schedule
from shiftlm.pipeline.greedy import greedy_order

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741 - the papers' names


def _one_f_one_b(
    pp: int, microbatches: int, rank: int, split_backward: bool, deferred_w: int
) -> list[Action]:
    """1F1B on rank `rank` of a loop placement: p-1-r warm-up forwards, then F/B pairs, then the rest.

    With `split_backward`, B becomes I and each I is followed by the W of the oldest pending
    micro-batch once more than `deferred_w` are pending; the rest fill the tail (ZB-H1).
    """
    warmup = min(pp - 1 - rank, microbatches)
    backward = I if split_backward else B
    actions = [Action(F, rank, j) for j in range(warmup)]
    pending_w: list[int] = []
    for j in range(microbatches):
        if warmup + j < microbatches:
            actions.append(Action(F, rank, warmup + j))
        actions.append(Action(backward, rank, j))
        if split_backward:
            pending_w.append(j)
            if len(pending_w) > deferred_w:
                actions.append(Action(W, rank, pending_w.pop(0)))
    actions += [Action(W, rank, j) for j in pending_w]
    return actions


def gpipe(pp: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """All forwards, then all backwards (Huang et al. 2019)."""
    return [
        [Action(F, r, j) for j in range(microbatches)] + [Action(B, r, j) for j in range(microbatches)]
        for r in range(pp)
    ]


def one_f_one_b(pp: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """PipeDream-flush 1F1B: at most p-r micro-batches in flight on rank r (Narayanan et al. 2019)."""
    return [_one_f_one_b(pp, microbatches, r, split_backward=False, deferred_w=0) for r in range(pp)]


def zb_h1(pp: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """ZB-H1: 1F1B with B split into I and W; rank r defers r W's to fill its tail (Qi et al. Sec. 3.1)."""
    return [_one_f_one_b(pp, microbatches, r, split_backward=True, deferred_w=r) for r in range(pp)]


def interleaved_1f1b(pp: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: v chunks per rank, micro-batches in groups of p per chunk.

    The k-th forward of a rank runs chunk (k // p) % v on micro-batch (k // (p v)) p + k % p; backwards
    walk the chunks in reverse. Warm-up: 2 (p-1-r) + (v-1) p forwards (Narayanan et al. 2021, Sec. 2.2).
    """
    total = microbatches * chunks

    def action(kind: Kind, rank: int, k: int) -> Action:
        chunk = (k // pp) % chunks
        if kind is not F:
            chunk = chunks - 1 - chunk
        return Action(kind, chunk * pp + rank, (k // (pp * chunks)) * pp + k % pp)

    ranks = []
    for rank in range(pp):
        warmup = min(2 * (pp - 1 - rank) + (chunks - 1) * pp, total)
        actions = [action(F, rank, k) for k in range(warmup)]
        for k in range(total):
            if warmup + k < total:
                actions.append(action(F, rank, warmup + k))
            actions.append(action(B, rank, k))
        ranks.append(actions)
    return ranks


def _zb_v_rank(pp: int, padded: int, rank: int) -> list[Action]:
    stage = (rank, 2 * pp - 1 - rank)  # chunk 0 goes down the V, chunk 1 comes back up
    count = {(kind, chunk): 0 for kind in (F, I, W) for chunk in (0, 1)}
    actions: list[Action] = []

    def emit(kind: Kind, chunk: int) -> None:
        actions.append(Action(kind, stage[chunk], count[(kind, chunk)]))
        count[(kind, chunk)] += 1

    for _ in range(2 * (pp - rank) - 1):
        emit(F, 0)
    for _ in range(rank):
        emit(F, 1), emit(F, 0)
    for _ in range(pp - rank):
        emit(F, 1), emit(I, 1), emit(W, 1)
    while count[(F, 1)] < count[(F, 0)] or count[(F, 0)] < padded:
        if count[(F, 0)] < padded:
            emit(F, 0)
        emit(I, 0), emit(W, 0), emit(F, 1), emit(I, 1), emit(W, 1)
    for _ in range(rank):
        emit(I, 0), emit(I, 1)
    for _ in range(pp - rank):
        emit(I, 0), emit(W, 0)
    for chunk in (1, 0):
        while count[(W, chunk)] < count[(I, chunk)]:
            emit(W, chunk)
    return actions


def zb_v(pp: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """ZB-V (Qi et al. 2023, Sec. 6): V placement, chunk 0 = stage r, chunk 1 = stage 2p-1-r.

    Phases per rank: 2(p-r)-1 chunk-0 forwards; r pairs (chunk-1 F, chunk-0 F); p-r triples
    (chunk-1 F, I, W); a steady state of (F, I, W) on chunk 0 then chunk 1; a cool-down of I's with W's
    deferred to the end. Built for max(m, 2p-1) micro-batches (the phases need that many), then the
    padding micro-batches are dropped, which keeps every dependency and the order of the rest.
    """
    padded = max(microbatches, 2 * pp - 1)
    return [[a for a in _zb_v_rank(pp, padded, rank) if a.microbatch < microbatches] for rank in range(pp)]


def zb_h2(pp: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """ZB-H2: up to 2p-1 micro-batches in flight per rank, so forwards fill the warm-up bubble and W's
    fill the tail (Qi et al. Sec. 3.1); the order is found by the greedy list scheduler."""
    placement = Placement(PlacementKind.LOOP, pp)
    return greedy_order(placement, microbatches, [2 * pp - 1] * pp, split_backward=True)


def bitpipe(pp: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """BitPipe (Wu et al. 2024): two V-shaped replicas in opposite directions on the same ranks, each
    taking half the micro-batches; full backwards; each chunk's gradients are synced across replicas
    (GRAD_SYNC) right after its last backward. Order from the greedy list scheduler with at most 3p
    stage-chunk activations in flight per rank (2p can starve the deeper chunks and stall).

    Messages are not free: the plain greedy order makes both ranks of a pair hand each other every
    chunk's output and wait for it at once (at pp 2 four such round trips per micro-batch pair). So a
    second order is built as if a message took half a chunk's forward (the greedy fills that gap with
    another micro-batch's work where the cap allows; if it gets stuck at the cap it is dropped), and
    the one that the simulator finishes first when a message takes a quarter of a chunk's forward is
    kept (ties: the second). pp 2, m 8: 24.25 vs 26.0 chunk-forward units (both 24.0 without message
    time); pp 4, m 8 keeps the plain order."""
    from shiftlm.pipeline.simulator import ActionCosts, simulate  # the simulator imports lowering only

    placement = Placement(PlacementKind.BIDIRECTIONAL, pp, 2)
    costs = ActionCosts(forward=1.0, backward_input=1.0, backward_weight=1.0, p2p=0.25)
    best: tuple[float, list[list[Action]]] | None = None
    for latency in (0.5, 0.0):
        try:
            ranks = greedy_order(
                placement, microbatches, [3 * pp] * pp, split_backward=False, grad_sync=True, latency=latency
            )
        except RuntimeError:  # the cap filled with forwards waiting on each other: keep the plain order
            continue
        schedule = Schedule("bitpipe", placement, microbatches, tuple(tuple(actions) for actions in ranks))
        makespan = simulate(schedule, costs).makespan
        if best is None or makespan < best[0]:
            best = (makespan, ranks)
    assert best is not None  # the plain order (latency 0) is the one the tests have always covered
    return best[1]


def _dualpipe_v_rank(pp: int, microbatches: int, rank: int) -> list[Action]:
    """DualPipeV on one rank, phase by phase as in deepseek-ai/DualPipe (dualpipev.py) and PyTorch's
    `ScheduleDualPipeV`: chunk 0 = stage r, chunk 1 = stage 2p-1-r; an overlapped (F, B) pair runs here
    as F then B (on one CPU stream there is nothing to overlap them with)."""
    stage = (rank, 2 * pp - 1 - rank)
    count: dict[tuple[Kind, int], int] = {}
    weights: list[tuple[int, int]] = []  # (chunk, micro-batch) of each deferred W, oldest first
    actions: list[Action] = []

    def emit(kind: Kind, chunk: int) -> None:
        counter = I if kind is B else kind  # a full B and an I advance the same backward counter
        j = count.get((counter, chunk), 0)
        count[(counter, chunk)] = j + 1
        actions.append(Action(kind, stage[chunk], j))
        if kind is I:
            weights.append((chunk, j))

    def weight() -> None:
        if weights:
            chunk, j = weights.pop(0)
            actions.append(Action(W, stage[chunk], j))

    for _ in range(2 * (pp - rank - 1)):  # 1: chunk-0 forwards
        emit(F, 0)
    for _ in range(rank + 1):  # 2: F0 F1
        emit(F, 0), emit(F, 1)
    for _ in range(pp - rank - 1):  # 3: I1 W F1 (zero bubble)
        emit(I, 1), weight(), emit(F, 1)
    for _ in range(microbatches - 2 * pp + rank + 1):  # 4: the steady state, (F0 B1) (F1 B0)
        emit(F, 0), emit(B, 1)
        emit(F, 1), emit(B, 0)
    for _ in range(pp - rank - 1):  # 5: B1 (F1 B0)
        emit(B, 1), emit(F, 1), emit(B, 0)
    split = False  # 6: B1 B0, the second half with the weight pass deferred
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        emit(I if split else B, 1)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        emit(I if split else B, 0)
    for _ in range(pp - rank - 1):  # 7: W B0
        weight(), emit(I if split else B, 0)
    while weights:  # 8: the remaining W's
        weight()
    return actions


def dualpipe_v(pp: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek-V3 technical report 2024, Sec. 3.2.1; the "cut-in-half" DualPipe of
    deepseek-ai/DualPipe): a V placement like ZB-V, a steady state of (F chunk 0, B chunk 1),
    (F chunk 1, B chunk 0) pairs whose compute and communication overlap on a GPU, and W's deferred
    only at the edges. Needs m >= 2p micro-batches."""
    return [_dualpipe_v_rank(pp, microbatches, rank) for rank in range(pp)]


@dataclass(frozen=True)
class ScheduleSpec:
    builder: Callable[[int, int, int], list[list[Action]]]
    placement: PlacementKind
    default_chunks: int
    chunks_fixed: bool  # V placements always have exactly 2 chunks per rank
    min_microbatches: Callable[[int], int]
    summary: str


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(gpipe, PlacementKind.LOOP, 1, True, lambda p: 1, "all F then all B"),
    "1f1b": ScheduleSpec(one_f_one_b, PlacementKind.LOOP, 1, True, lambda p: p, "one forward, one backward"),
    "interleaved_1f1b": ScheduleSpec(
        interleaved_1f1b, PlacementKind.LOOP, 2, False, lambda p: p, "v chunks per rank, loop placement"
    ),
    "zb_h1": ScheduleSpec(zb_h1, PlacementKind.LOOP, 1, True, lambda p: p, "1F1B memory, W fills the tail"),
    "zb_h2": ScheduleSpec(zb_h2, PlacementKind.LOOP, 1, True, lambda p: p, "zero bubble, 2p-1 in flight"),
    "zb_v": ScheduleSpec(
        zb_v, PlacementKind.V, 2, True, lambda p: p, "zero bubble, V placement, 1F1B memory"
    ),
    "bitpipe": ScheduleSpec(
        bitpipe, PlacementKind.BIDIRECTIONAL, 2, True, lambda p: p, "two V replicas in opposite directions"
    ),
    "dualpipe_v": ScheduleSpec(
        dualpipe_v,
        PlacementKind.V,
        2,
        True,
        lambda p: 2 * p,
        "V placement, overlapped F/B pairs (DeepSeek-V3)",
    ),
}


def check_requirements(name: str, pp: int, microbatches: int, chunks: int | None) -> int:
    """Return the chunk count to use, or raise ValueError saying what is wrong and how to fix it."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    spec = SCHEDULES[name]
    if pp < 2:
        raise ValueError(f"{name} needs at least 2 pipeline ranks, got pp={pp}")
    resolved = spec.default_chunks if chunks is None else chunks
    if spec.chunks_fixed and resolved != spec.default_chunks:
        raise ValueError(
            f"{name} always uses {spec.default_chunks} chunk(s) per rank; drop --chunks {chunks}"
        )
    if resolved < 2 and not spec.chunks_fixed:
        raise ValueError(f"{name} needs at least 2 chunks per rank, got {resolved}; use 1f1b for 1 chunk")
    if microbatches < spec.min_microbatches(pp):
        raise ValueError(
            f"{name} needs at least {spec.min_microbatches(pp)} micro-batches for pp={pp} "
            f"(got {microbatches}); raise --microbatches or lower --pp"
        )
    if name == "interleaved_1f1b" and microbatches % pp:
        raise ValueError(f"interleaved_1f1b needs micro-batches divisible by pp={pp}, got {microbatches}")
    if name == "bitpipe" and microbatches % 2:
        raise ValueError(
            f"bitpipe splits the micro-batches between 2 replicas; use an even number, got {microbatches}"
        )
    return resolved


def build_schedule(name: str, pp: int, microbatches: int, chunks: int | None = None) -> Schedule:
    """The compute-only schedule `name` for `pp` ranks and `microbatches` micro-batches.

    `chunks` is the number of stages per rank (per replica): v for interleaved_1f1b (default 2);
    gpipe/1f1b/zb_h1/zb_h2 use 1, zb_v/bitpipe/dualpipe_v 2, and reject any other value.
    """
    resolved = check_requirements(name, pp, microbatches, chunks)
    spec = SCHEDULES[name]
    placement = Placement(spec.placement, pp, resolved)
    ranks = spec.builder(pp, microbatches, resolved)
    return Schedule(name, placement, microbatches, tuple(tuple(actions) for actions in ranks))
