"""DeepSpeed's `flops_profiler` section and zerodist's `zerodist.timeline` section: what to record of
a step and where (zerodist/debug/timeline.py and flops.py do the work; docs/timeline.md)."""

from __future__ import annotations

from pydantic import Field

from zerodist.config.fields import Section


class FlopsProfilerConfig(Section):
    enabled: bool = Field(
        False, description="Count the FLOPs of step profile_step per module (torch's FLOP counter over matrix "
        "products, every forward and backward of the step) and log the profile on rank 0 with FLOP/s (and MFU on a "
        "GPU of the table); the engine does it in a loop of your own. zerodist train always counts them (this "
        "section sets which step and what is printed) and reports MFU against a CPU's measured peak too."
    )
    recompute_fwd_factor: float = Field(
        0.0, ge=0, description="Accepted for DeepSpeed compatibility: the FLOPs counted are the ones that ran, "
        "recomputation included."
    )
    profile_step: int = Field(1, ge=1, description="The optimizer step whose FLOPs are counted.")

    module_depth: int = Field(-1, ge=-1, description="Deepest module level printed in the per-module table (the "
                              "model is 0); -1: all.")
    top_modules: int = Field(1, ge=0, description="Modules printed per level of the table, largest first; 0: all.")
    detailed: bool = Field(True, description="Print the per-module table (false: the totals only).")
    output_file: str | None = Field(
        None, description="Write the profile to this file instead of the log (rank 0)."
    )


class ZerodistTimelineConfig(Section):
    enabled: bool = Field(
        False, description="Record a timeline of the chosen steps on every rank (compute spans, every collective "
        "with issue/wait/completion, p2p messages, swap I/O, waits) and merge it on rank 0: what `zerodist train "
        "--trace` sets; in a loop of your own the engine records them around its forward/backward/step and writes "
        "the same files right after the last chosen step."
    )
    start_step: int = Field(2, ge=1, description="The first optimizer step recorded (the first is warm-up).")
    num_steps: int = Field(1, ge=1, description="How many consecutive steps are recorded.")
    output_dir: str | None = Field(
        None, description="Where timeline.json and traces/rank<r>.json go; null: <zerodist train --out>/timeline, "
        "or ./timeline in a loop of your own."
    )
    torch_profiler: bool = Field(
        True, description="Also run torch.profiler over the recorded steps and keep each rank's trace "
        "(Holistic Trace Analysis reads them); false records only zerodist's spans (cheaper)."
    )
    module_spans: bool = Field(
        True, description="Forward and backward spans per top-level module (a ModuleList's items), from hooks."
    )
