"""Gantt chart of a simulated schedule: one row per rank, a colour per action kind, a lighter shade of
it per further chunk (stage) a rank holds, so the V of ZB-V and the loops of interleaved schedules show;
the legend sits beside the bars, never over them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shiftlm.pipeline.actions import COMPUTE_KINDS, Kind
from shiftlm.pipeline.simulator import SimulationResult

COLOURS = {Kind.F: "#4c72b0", Kind.B: "#55a868", Kind.I: "#8fd19e", Kind.W: "#c44e52"}
TIME_UNIT = "time (units of --costs: F = one micro-batch's forward through one rank's 1/pp of the model)"


@dataclass
class GanttLayout:
    """Where the chart put things, in pixels of the written PNG (the tests check them)."""

    bars_px: tuple[float, float, float, float]  # x0, y0, x1, y1 of the bars' area (the axes)
    legend_px: tuple[float, float, float, float]
    colours: dict[tuple[int, int], set[str]] = field(default_factory=dict)  # (rank, chunk) -> colours


def shade(colour: str, chunk: int, chunks: int) -> str:
    """`colour` for chunk 0, blended towards white for later chunks (up to 60%)."""
    from matplotlib.colors import to_hex, to_rgb

    mix = 0.6 * chunk / max(chunks - 1, 1)
    return to_hex(tuple(c + (1 - c) * mix for c in to_rgb(colour)))


def plot_gantt(result: SimulationResult, title: str, path: str | Path, unit: str = TIME_UNIT) -> GanttLayout:
    """Draw every compute action as a bar labelled with its micro-batch; write a PNG to `path`."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    num_ranks = len(result.timelines)
    fig, ax = plt.subplots(figsize=(max(8.0, result.makespan * 0.25) + 1.6, 0.6 * num_ranks + 1.4))
    stages = [sorted({a.stage for _, _, a in t if a.kind in COMPUTE_KINDS}) for t in result.timelines]
    chunks = max((len(s) for s in stages), default=1)
    colours: dict[tuple[int, int], set[str]] = {}
    legend: dict[str, str] = {}
    for rank, timeline in enumerate(result.timelines):
        for start, end, action in timeline:
            if action.kind not in COMPUTE_KINDS or end <= start:
                continue
            chunk = stages[rank].index(action.stage)
            colour = shade(COLOURS[action.kind], chunk, chunks)
            colours.setdefault((rank, chunk), set()).add(colour)
            legend[f"{action.kind.value}" + (f" chunk {chunk}" if chunks > 1 else "")] = colour
            # replica 1 (BitPipe) is hatched so the two directions can be told apart
            ax.barh(
                rank,
                end - start,
                left=start,
                color=colour,
                edgecolor="black",
                linewidth=0.4,
                hatch="//" if action.replica else None,
            )
            ax.text((start + end) / 2, rank, str(action.microbatch), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel(unit)
    ax.set_title(f"{title}: bubble {result.bubble_fraction:.1%}, makespan {result.makespan:g}")
    ordered = sorted(legend.items(), key=lambda item: ([k.value for k in COLOURS].index(item[0][0]), item[0]))
    drawn = ax.legend(
        handles=[Patch(facecolor=c, edgecolor="black", linewidth=0.4, label=name) for name, c in ordered],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),  # outside the axes, right of the bars
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    renderer = fig.canvas.get_renderer()
    layout = GanttLayout(
        tuple(ax.get_window_extent(renderer).extents),
        tuple(drawn.get_window_extent(renderer).extents),
        colours,
    )
    plt.close(fig)
    return layout
