"""The pipeline as a picture: ranks x time, one bar per forward / backward / weight-gradient action.

    draw_pipeline([("as it ran", measured_rows), ("simulator's plan", planned_rows)], "pipeline.png")

Each panel is one schedule: a row per pipe rank, a bar per compute action coloured by kind (F
blue, B green, I orange, W purple) with its micro-batch number (and stage, when a rank holds
several), the gaps between bars left blank: the bubble. Each panel's title carries its idle
share (`timeline_analysis.idle_share`, the same arithmetic as the schedule simulator's). The
rows are plain `Bar`s, so a measured run (from the timeline's spans) and a plan (from
`zerodist.pipe`'s simulator, converted by the caller) are drawn by the same code. matplotlib is
imported only here, when a picture is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from pathlib import Path

from zerodist.debug.timeline_analysis import Bar

__all__ = ["COLOURS", "draw_pipeline"]

COLOURS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3"}
_NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}


def draw_pipeline(panels: Sequence[tuple[str, Sequence[Sequence[Bar]], str]], path: str | Path,
                  title: str | None = None) -> list[float]:
    """Draw each (title, rows, time unit) panel, one above the other, to `path` (PNG); returns each
    panel's idle share as drawn (from the bars on the axes, not from `rows`). The time unit labels
    the x axis ("ms" for a run, "time units" for a plan)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a training node; must precede pyplot's import
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heights = [max(1, len(rows)) * 0.55 + 0.9 for _, rows, _ in panels]
    figure, axes_list = plt.subplots(len(panels), 1, figsize=(12, sum(heights) + 0.6), squeeze=False,
                                     gridspec_kw={"height_ratios": heights})
    shares = []
    for axes, (name, rows, unit) in zip(axes_list[:, 0], panels):
        _draw_panel(axes, rows, unit)
        share = _drawn_idle_share(axes, len(rows))
        shares.append(share)
        axes.set_title(f"{name}: idle {share:.1%} of all ranks' time", fontsize=10, loc="left")
    kinds = sorted({b.kind for _, rows, _ in panels for row in rows for b in row}, key="FBIW".index)
    figure.legend(handles=[Patch(color=COLOURS[k], label=_NAMES[k]) for k in kinds], loc="upper right", ncol=len(kinds),
                  fontsize=9, frameon=False)
    if title:
        figure.suptitle(title, x=0.01, ha="left", fontsize=11)
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return shares


def _drawn_idle_share(axes: Any, num_rows: int) -> float:
    """Idle share of the bars on `axes`: 1 - their widths over (span of the bars x rows)."""
    bars = [(patch.get_x(), patch.get_width()) for patch in axes.patches]
    if not bars or not num_rows:
        return 0.0
    span = max(x + w for x, w in bars) - min(x for x, _ in bars)
    return 1.0 - sum(w for _, w in bars) / (span * num_rows) if span > 0 else 0.0


def _draw_panel(axes: Any, rows: Sequence[Sequence[Bar]], unit: str) -> None:
    scale = 1e3 if unit == "ms" else 1.0  # a run's bars are in seconds
    several = {b.stage for row in rows for b in row} != {i for i in range(len(rows))}
    end = max((b.end for row in rows for b in row), default=1.0) * scale
    for rank, row in enumerate(rows):
        for bar in row:
            left, width = bar.start * scale, (bar.end - bar.start) * scale
            axes.barh(rank, width, left=left, height=0.8, color=COLOURS.get(bar.kind, "grey"),
                      edgecolor="white", linewidth=0.6)
            label = f"{bar.microbatch}" if not several else f"{bar.microbatch}.{bar.stage}"
            if width > end * 0.012 * len(label):
                axes.text(left + width / 2, rank, label, ha="center", va="center", fontsize=7,
                          color="white")
    axes.set_yticks(range(len(rows)))
    axes.set_yticklabels([f"rank {r}" for r in range(len(rows))])
    axes.set_ylim(len(rows) - 0.5, -0.5)
    axes.set_xlim(0, end * 1.01)
    axes.set_xlabel(unit)
    axes.grid(axis="x", alpha=0.25)
