"""DeepSpeed's `flops_profiler` section and zerodist's `zerodist.timeline` section: what to record of
a step and where (zerodist/debug/timeline.py and flops.py do the work; docs/timeline.md)."""

from __future__ import annotations

import logging

from pydantic import Field, field_validator

from zerodist.config.fields import Section
from zerodist.utils import get_logger, log_rank0

logger = get_logger(__name__)


class FlopsProfilerConfig(Section):
    enabled: bool = Field(
        False, description="Count the FLOPs of one step per module (torch's FLOP counter over matrix products) and "
        "report FLOP/s and MFU against the device's peak. zerodist train always counts them (this section sets "
        "which step and what is printed); in a loop of your own call zerodist.debug.flops.count_flops."
    )
    recompute_fwd_factor: float = Field(
        0.0, ge=0, description="Accepted for DeepSpeed compatibility: the FLOPs counted are the ones that ran, "
        "recomputation included."
    )
    profile_step: int = Field(1, ge=1, description="The optimizer step whose FLOPs are counted.")

    @field_validator("enabled")
    @classmethod
    def _says_who_counts(cls, value: bool) -> bool:
        if value:  # DeepSpeed's engine counts by itself; zerodist's engine does not (yet): say so once per load
            log_rank0(logger, "flops_profiler.enabled: zerodist train counts FLOPs and reports MFU; an engine driven by "
                      "a loop of your own does not: call zerodist.debug.flops.count_flops around a step "
                      "(docs/timeline.md)", level=logging.WARNING)
        return value
    module_depth: int = Field(-1, ge=-1, description="Deepest module level printed in the per-module table; -1: all.")
    top_modules: int = Field(1, ge=0, description="Modules printed per level of the table, largest first; 0: all.")
    detailed: bool = Field(True, description="Print the per-module table (false: the totals only).")
    output_file: str | None = Field(
        None, description="Write the report to this file instead of the log (rank 0)."
    )


class ZerodistTimelineConfig(Section):
    enabled: bool = Field(
        False, description="Record a timeline of the chosen steps on every rank (compute spans, every collective "
        "with issue/wait/completion, p2p messages, swap I/O, waits) and merge it on rank 0: what `zerodist train "
        "--trace` sets; in a loop of your own use zerodist.debug.timeline.StepTimeline."
    )
    start_step: int = Field(2, ge=1, description="The first optimizer step recorded (the first is warm-up).")
    num_steps: int = Field(1, ge=1, description="How many consecutive steps are recorded.")
    output_dir: str | None = Field(
        None, description="Where timeline.json and traces/rank<r>.json go; null: <zerodist train --out>/timeline."
    )
    torch_profiler: bool = Field(
        True, description="Also run torch.profiler over the recorded steps and keep each rank's trace "
        "(Holistic Trace Analysis reads them); false records only zerodist's spans (cheaper)."
    )
    module_spans: bool = Field(
        True, description="Forward and backward spans per top-level module (a ModuleList's items), from hooks."
    )
