"""Gantt chart of a simulated schedule: one row per rank, one colour per action kind."""

from __future__ import annotations

from pathlib import Path

from shiftlm.pipeline.actions import COMPUTE_KINDS, Kind
from shiftlm.pipeline.simulator import SimulationResult

COLOURS = {Kind.F: "#4c72b0", Kind.B: "#55a868", Kind.I: "#8fd19e", Kind.W: "#c44e52"}


def plot_gantt(result: SimulationResult, title: str, path: str | Path) -> None:
    """Draw every compute action as a bar labelled with its micro-batch; write a PNG to `path`."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    num_ranks = len(result.timelines)
    fig, ax = plt.subplots(figsize=(max(8.0, result.makespan * 0.25), 0.6 * num_ranks + 1.2))
    for rank, timeline in enumerate(result.timelines):
        for start, end, action in timeline:
            if action.kind not in COMPUTE_KINDS or end <= start:
                continue
            # replica 1 (BitPipe) is hatched so the two directions can be told apart
            ax.barh(
                rank,
                end - start,
                left=start,
                color=COLOURS[action.kind],
                edgecolor="black",
                linewidth=0.4,
                hatch="//" if action.replica else None,
            )
            ax.text((start + end) / 2, rank, str(action.microbatch), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(f"{title}: bubble {result.bubble_fraction:.1%}, makespan {result.makespan:g}")
    used = {a.kind for timeline in result.timelines for _, _, a in timeline}
    ax.legend(
        handles=[Patch(color=c, label=k.value) for k, c in COLOURS.items() if k in used],
        loc="upper right",
        fontsize=7,
        ncol=4,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
