"""train_bench.py's rows into medians, ratios and markdown tables (pure functions over the rows).

A row is one configuration at one size: phase 1's fields (`isolated_ms`, `state_bytes`,
`peak_rss`, `memory`, `gloo_ops`, `gloo_in_flight_ms`, `tracer`, `final_loss`) when it ran, and `runs`,
one entry per interleaved run with each rank's per-step samples in seconds (`wall`, `cpu`,
`idle`, `blocked`; `blocked` is None for frameworks other than zerodist) or an `error`.
"""

from __future__ import annotations

import statistics
from typing import Any

KEYS = ("wall", "cpu", "idle", "blocked")


def _median_ms(samples: list[float | None]) -> float | None:
    values = [s for s in samples if s is not None]
    return 1e3 * statistics.median(values) if values else None


def summarize_run(run: dict[str, Any]) -> dict[str, Any] | None:
    """One interleaved run of one configuration: rank 0's median wall ms, and per rank the median
    CPU, off-CPU and blocked ms. None for a failed run."""
    if "error" in run:
        return None
    per_rank = {key: [_median_ms(samples) for samples in run[key]] for key in KEYS}
    return {"step_ms": per_rank["wall"][0], "cpu_ms": per_rank["cpu"], "idle_ms": per_rank["idle"],
            "blocked_ms": per_rank["blocked"] if any(v is not None for v in per_rank["blocked"]) else None,
            "load_average": run.get("load_average")}


def summarize_interleaved(row: dict[str, Any]) -> dict[str, Any]:
    """Adds `per_run` (summarize_run of each run, aligned with `runs`) and their medians over runs:
    `step_ms`, `cpu_ms`, `idle_ms`, `blocked_ms`, and `step_ms_iqr` (quartiles of rank 0's
    pooled samples)."""
    runs = row.get("runs") or []
    per_run = [summarize_run(run) for run in runs]
    done = [r for r in per_run if r is not None]
    row = {**row, "per_run": per_run}
    if not done:
        if runs:
            row["interleaved_error"] = next(run["error"] for run in runs if "error" in run)
        return row
    row["step_ms"] = statistics.median(r["step_ms"] for r in done)
    for key in ("cpu_ms", "idle_ms", "blocked_ms"):
        columns = [r[key] for r in done if r[key] is not None]
        row[key] = [statistics.median(rank) for rank in zip(*columns)] if columns else None
    pooled = [s for run in runs if "error" not in run for s in run["wall"][0]]
    row["step_ms_iqr"] = [1e3 * q for q in statistics.quantiles(pooled, n=4)[::2]] if len(pooled) > 1 else None
    return row


def _peer(rows: list[dict[str, Any]], row: dict[str, Any], framework: str) -> dict[str, Any] | None:
    """The row `row` is compared with: DDP, or DeepSpeed at the same stage and reuse (stage 0 for
    DDP, stage 3 with reuse for FSDP2)."""
    same_size = [r for r in rows if r["size"] == row["size"]]
    if framework == "ddp":
        return next((r for r in same_size if r["framework"] == "ddp"), None)
    stage = 0 if row["framework"] == "ddp" else row["stage"]
    reuse = row.get("reuse", True)
    return next((r for r in same_size if r["label"].startswith("deepspeed") and r["stage"] == stage
                 and r.get("reuse", True) == reuse), None)


def _ratios(row: dict[str, Any], base: dict[str, Any]) -> list[tuple[float, float] | None]:
    """(wall, CPU summed over ranks) ratio of each run to the same run of `base`."""
    out: list[tuple[float, float] | None] = []
    for mine, theirs in zip(row.get("per_run") or [], base.get("per_run") or []):
        if mine is None or theirs is None:
            out.append(None)
        else:
            out.append((mine["step_ms"] / theirs["step_ms"], sum(mine["cpu_ms"]) / sum(theirs["cpu_ms"])))
    return out


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Per run and as the median over runs: each configuration's step time (wall; CPU summed over
    ranks) over DDP's and over DeepSpeed's at the same stage, from the same interleaved run."""
    for row in rows:
        for name in ("ddp", "deepspeed"):
            base = _peer(rows, row, name)
            runs = _ratios(row, base) if base is not None else []
            row[f"runs_vs_{name}"] = runs
            done = [r for r in runs if r is not None]
            row[f"vs_{name}"] = statistics.median(r[0] for r in done) if done else None
            row[f"cpu_vs_{name}"] = statistics.median(r[1] for r in done) if done else None


# ------------------------------------------------------------------------------------ formatting
def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f}"


def format_bytes(num_bytes: float) -> str:
    from zerodist.utils import format_bytes as zerodist_format

    return zerodist_format(num_bytes)


def comm_cell(row: dict[str, Any]) -> str:
    parts = []
    if row.get("tracer"):
        parts.append("tracer: " + ", ".join(f"{op} {s['count']:g}x {format_bytes(s['bytes'])}"
                                            for op, s in row["tracer"].items()))
    gloo = row.get("gloo_ops") or {}
    if gloo:
        parts.append("gloo: " + ", ".join(f"{op} {len(n)}x {format_bytes(4 * sum(n))}" for op, n in gloo.items()))
    return "; ".join(parts) or "-"


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _ranks(values: list[float | None] | None, joiner: str = " / ") -> str:
    return "n/a" if not values else joiner.join("-" if v is None else f"{v:.0f}" for v in values)


def _each_run(runs: list[tuple[float, float] | None]) -> str:
    return ", ".join("-" if r is None else f"{r[0]:.2f}" for r in runs) or "-"


def step_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| framework | stage | step ms | quartiles | CPU ms (r0+r1) | off-CPU ms (r0 / r1) "
             "| blocked in zerodist.comm ms (r0 / r1) | vs DDP (wall / CPU) | vs DDP each run (wall) "
             "| vs DeepSpeed (wall / CPU) | vs DeepSpeed each run (wall) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "step_ms" not in r:
            why = r.get("interleaved_error") or r.get("error") or "not run"
            lines.append(f"| {r['framework']} | {r['stage']} | {why} | | | | | | | | |")
            continue
        low, high = r.get("step_ms_iqr") or (None, None)
        lines.append(
            f"| {r['framework']} | {r['stage']} | {r['step_ms']:.1f} | "
            f"{'-' if low is None else f'{low:.0f}-{high:.0f}'} | {_ranks(r['cpu_ms'], ' + ')} | "
            f"{_ranks(r['idle_ms'])} | {_ranks(r['blocked_ms'])} | "
            f"{ratio(r.get('vs_ddp'))} / {ratio(r.get('cpu_vs_ddp'))} | {_each_run(r.get('runs_vs_ddp') or [])} | "
            f"{ratio(r.get('vs_deepspeed'))} / {ratio(r.get('cpu_vs_deepspeed'))} | "
            f"{_each_run(r.get('runs_vs_deepspeed') or [])} |")
    return lines


def alone_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| framework | stage | alone ms | model state / rank (MiB) | peak RSS / rank, build; train (MiB) "
             "| collectives per step (rank 0) | final loss |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "isolated_ms" not in r:
            lines.append(f"| {r['framework']} | {r['stage']} | {r.get('error', 'not run')} | | | | |")
            continue
        peaks = " / ".join(f"{mib(m['init_peak'])}; {mib(m['train_peak'])}" for m in r["memory"])
        lines.append(f"| {r['framework']} | {r['stage']} | {r['isolated_ms']:.1f} | "
                     f"{' / '.join(mib(b) for b in r['state_bytes'])} | {peaks} | "
                     f"{comm_cell(r)} | {r['final_loss']:.4f} |")
    return lines


def memory_parts(memory: dict[str, int]) -> dict[str, int]:
    """The training peak's parts; `rest` is what they do not explain, and `allocator_held` the part
    of the peak above the baseline that was not in use by the heap at any sample (memory_breakdown.py)."""
    parts = {key: memory[key] for key in ("baseline", "model_states", "activations", "gathered_params", "grad_staging")}
    above_baseline = memory["train_peak"] - memory["baseline"]
    return {**parts, "rest": memory["train_peak"] - sum(parts.values()),
            "allocator_held": above_baseline - memory.get("heap_peak", above_baseline)}


def memory_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| framework | stage | training peak RSS | baseline | model states | activations | gathered params "
             "| gradient staging | rest | of which held by the allocator | vs DeepSpeed, same stage "
             "(peak / peak less baseline) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "memory" not in r:
            continue
        memory, parts = r["memory"][0], memory_parts(r["memory"][0])
        peer = _peer(rows, r, "deepspeed")
        versus = "-"
        if peer is not None and "memory" in peer and peer is not r:
            theirs = peer["memory"][0]
            versus = (f"{memory['train_peak'] / theirs['train_peak']:.2f}x / "
                      f"{(memory['train_peak'] - memory['baseline']) / (theirs['train_peak'] - theirs['baseline']):.2f}x")
        cells = " | ".join(mib(parts[key]) for key in ("baseline", "model_states", "activations", "gathered_params",
                                                          "grad_staging", "rest", "allocator_held"))
        lines.append(f"| {r['framework']} | {r['stage']} | {mib(memory['train_peak'])} | {cells} | {versus} |")
    return lines


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, ""]
    for size in dict.fromkeys(r["size"] for r in rows):
        mine = [r for r in rows if r["size"] == size]
        params = next((r["num_parameters"] for r in mine if "num_parameters" in r), None)
        num_runs = max((len(r.get("runs") or []) for r in mine), default=0)
        lines += [f"### {size}" + (f" ({params:,} parameters)" if params else ""), ""]
        if num_runs:
            lines += [f"Interleaved, {num_runs} run(s): medians over runs; ratios are the median of the runs' ratios.",
                      "", *step_table(mine), ""]
        if any("isolated_ms" in r or "error" in r for r in mine) and any("isolated_ms" in r for r in mine):
            lines += ["Each configuration alone:", "", *alone_table(mine), ""]
        if any("memory" in r for r in mine):
            lines += ["Where the training peak goes, rank 0 (MiB; memory_breakdown.py):", "", *memory_table(mine), ""]
    return "\n".join(lines)
