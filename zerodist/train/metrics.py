"""Per-step metrics of a training run and the files a run leaves behind (memory readers: zerodist.debug.memory).

    metrics.csv   step, loss (averaged over ranks), lr, tokens_per_s (all ranks), rss_mib (rank 0), tflops and
                  mfu (rank 0, from the step whose FLOPs were counted on), forward_ms, backward_ms, step_ms
    loss.png      the loss curve (matplotlib, a dependency, imported only here; skipped with a message
                  when an installation lacks it)
"""

from __future__ import annotations

import collections
import csv
import dataclasses
from pathlib import Path

CSV_FIELDS = ("step", "loss", "lr", "tokens_per_s", "rss_mib", "tflops", "mfu", "forward_ms", "backward_ms", "step_ms")
# Blank until known: TFLOP/s of rank 0 and its MFU from the counted step on (zerodist/train/observe.py),
# the wall-clock breakdown of the step summed over its micro-steps.
_OPTIONAL = ("tflops", "mfu", "forward_ms", "backward_ms", "step_ms")
MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class StepRecord:
    """One optimizer step as seen by rank 0 (the loss is already the mean over ranks). A record
    with its `extra` columns costs about 560 bytes (tracemalloc: the record, its dict, the boxed
    numbers): a run keeps only `StepHistory.WINDOW` of them ([Note: bounded step history])."""

    step: int
    loss: float
    lr: float
    tokens_per_s: float
    rss_bytes: int
    extra: dict[str, float | None] = dataclasses.field(default_factory=dict)  # _OPTIONAL's columns

    def csv_row(self) -> dict[str, str]:
        row = {"step": str(self.step), "loss": f"{self.loss:.6f}", "lr": f"{self.lr:.6g}",
               "tokens_per_s": f"{self.tokens_per_s:.1f}", "rss_mib": f"{self.rss_bytes / MIB:.1f}"}
        for name in _OPTIONAL:
            value = self.extra.get(name)
            row[name] = "" if value is None else f"{value:.6g}"
        return row


class StepHistory:
    """What a run keeps in memory of its steps: their count, the first loss and the last `WINDOW`
    records. Bounded whatever the run's length ([Note: bounded step history])."""

    WINDOW = 10  # the summary's "mean of the last 10 steps"

    def __init__(self) -> None:
        self.count = 0
        self.first_loss: float | None = None
        self.recent: collections.deque[StepRecord] = collections.deque(maxlen=self.WINDOW)

    def append(self, record: StepRecord) -> None:
        if self.first_loss is None:
            self.first_loss = record.loss
        self.count += 1
        self.recent.append(record)

    def __len__(self) -> int:
        return self.count

    def recent_losses(self) -> list[float]:
        return [r.loss for r in self.recent]


# [Note: bounded step history] Every record kept for the run's end (the summary's loss line,
# loss.png, a rewrite of metrics.csv) grew memory by about 0.5 KiB a step: the RSS creep of the
# 2000-step demo (issue 37). The rows go to metrics.csv as they are made (MetricsLog); the
# summary needs the first loss and the last WINDOW; loss.png reads metrics.csv back at the end
# (rank 0, once). So the records a run holds are at most WINDOW, however long it trains.


def write_csv(records: list[StepRecord], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(r.csv_row() for r in records)


def read_losses(path: Path) -> tuple[list[int], list[float]]:
    """The (steps, losses) columns of metrics.csv, for loss.png at the end of a run; empty when
    the file is absent or unreadable."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]
    except (OSError, KeyError, ValueError, TypeError):
        return [], []
    return [step for step, _ in rows], [loss for _, loss in rows]


def read_csv(path: Path, up_to_step: int) -> list[StepRecord]:
    """The rows of an earlier run's metrics.csv up to `up_to_step` (the checkpoint resumed from:
    later rows are trained again); none when the file is absent or unreadable."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        records = [StepRecord(int(r["step"]), float(r["loss"]), float(r["lr"]), float(r["tokens_per_s"]),
                              int(float(r["rss_mib"]) * MIB),
                              {name: float(r[name]) for name in _OPTIONAL if r.get(name)}) for r in rows]
    except (OSError, KeyError, ValueError, TypeError):
        return []
    return [r for r in records if r.step <= up_to_step]


class MetricsLog:
    """metrics.csv written a row per step, flushed, so a run killed midway keeps its history and
    a resumed run continues it ([Note: metrics across resumes])."""

    def __init__(self, path: Path, history: list[StepRecord]):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_csv(history, path)
        self.file = open(path, "a", newline="", encoding="utf-8")
        self.writer = csv.DictWriter(self.file, fieldnames=CSV_FIELDS)

    def append(self, record: StepRecord) -> None:
        self.writer.writerow(record.csv_row())
        self.file.flush()

    def close(self) -> None:
        self.file.close()


# [Note: metrics across resumes] A resumed run restarts at the checkpoint's step, so the rows an
# earlier run wrote after that step are trained again: they are dropped and rewritten, and the
# rows up to it are kept. metrics.csv and loss.png thus always cover steps 1..N of one history.


def plot_loss(steps: list[int], losses: list[float], path: Path, title: str) -> str | None:
    """Write the loss curve to `path`; returns why it was skipped, or None when written."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no loss curve written"
    matplotlib.use("Agg")  # no display on a training node; must precede pyplot's import
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(steps, losses, linewidth=1.2)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss (mean over ranks)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return None
