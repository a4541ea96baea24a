"""DeepSpeed's `zero_optimization.offload_optimizer` and `offload_param` sections, with DeepSpeed's
defaults, and what they may ask for (zerodist/offload does the work; docs/offload.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from zerodist.config.fields import ElementCount, Section


class OffloadOptimizerConfig(Section):
    device: Literal["none", "cpu", "nvme"] = Field(
        "none", description="Where the optimizer state lives between steps: none (with the parameters), cpu (the "
        "host; with parameters on the CPU already this changes nothing), nvme (swap files under nvme_path, streamed "
        "through host buffers sub_group_size elements at a time around the step). Stages 1, 2 and 3."
    )
    nvme_path: str | None = Field(
        None, description="nvme: the directory the swap files go under (<nvme_path>/<run>/rank<r>/); it must "
        "exist and be writable."
    )
    pin_memory: bool = Field(
        False, description="Page-locked host buffers (for an accelerator's copies); no effect on the CPU."
    )
    buffer_count: int = Field(
        4, ge=1, description="nvme: host buffers of one sub-group each; 2 or more let reads and writes overlap "
        "the step."
    )
    pipeline_read: bool = Field(
        False, description="nvme: read sub-group i+1 from its swap file while sub-group i is stepped."
    )
    pipeline_write: bool = Field(
        False, description="nvme: write sub-group i back while the following ones are stepped."
    )
    fast_init: bool = Field(
        False, description="Accepted for DeepSpeed compatibility: swap files are created at the first step here."
    )
    ratio: float = Field(
        1.0, gt=0, le=1, description="Fraction of the optimizer state offloaded; only 1.0 (all of it) is implemented."
    )


class OffloadParamConfig(Section):
    device: Literal["none", "cpu", "nvme"] = Field(
        "none", description="Stage 3: where parameter shards live between uses: none, cpu (changes nothing with "
        "parameters on the CPU) or nvme (in the optimizer's swap files, read before each gather; needs "
        "offload_optimizer.device nvme)."
    )
    nvme_path: str | None = Field(None, description="nvme: unset, or offload_optimizer's nvme_path (the shards "
                                  "live in its swap files).")
    buffer_count: int = Field(5, ge=1, description="Accepted for DeepSpeed compatibility: a gather reads its "
                              "shard into a pooled transient buffer.")
    buffer_size: ElementCount = Field(100_000_000, description="Accepted for DeepSpeed compatibility (as buffer_count).")
    max_in_cpu: ElementCount = Field(
        1_000_000_000, description="Accepted for DeepSpeed compatibility: every sharded parameter is swapped "
        "(stage 3's persistent parameters stay in memory)."
    )
    pin_memory: bool = Field(
        False, description="Page-locked host buffers (for an accelerator's copies); no effect on the CPU."
    )

    @field_validator("buffer_size", "max_in_cpu", mode="before")
    @classmethod
    def _integral(cls, value: Any) -> Any:
        return int(value) if isinstance(value, float) and value.is_integer() else value


def offload_problems(stage: int, optimizer: OffloadOptimizerConfig | None, param: OffloadParamConfig | None) -> list[str]:
    """What the offload sections ask for that DeepSpeed would not run, or zerodist does not implement."""
    problems = []
    if optimizer is not None and optimizer.device != "none":
        if stage == 0:
            problems.append(f"'zero_optimization.offload_optimizer.device' is \"{optimizer.device}\" at stage 0; "
                            "offload needs ZeRO stage 1, 2 or 3")
        if optimizer.device == "nvme" and not optimizer.nvme_path:
            problems.append("'zero_optimization.offload_optimizer.device' is \"nvme\" but 'nvme_path' is not set; "
                            "name the directory the swap files go under")
        if optimizer.ratio != 1.0:
            problems.append(f"'zero_optimization.offload_optimizer.ratio' is {optimizer.ratio}; zerodist offloads "
                            "all of the optimizer state (1.0) or none")
    if param is not None and param.device != "none":
        if stage != 3:
            problems.append(f"'zero_optimization.offload_param' is set at stage {stage}; parameters are "
                            "offloaded at stage 3 only (DeepSpeed's rule); remove it or use stage 3")
        if param.device == "nvme" and (optimizer is None or optimizer.device != "nvme"):
            problems.append("'zero_optimization.offload_param.device' is \"nvme\" but offload_optimizer.device is "
                            f"\"{'none' if optimizer is None else optimizer.device}\": zerodist keeps the parameter "
                            "shards in the optimizer's swap files (at fp32 the shard is the tensor the optimizer "
                            "steps), so set offload_optimizer.device to \"nvme\" too")
        if (param.device == "nvme" and param.nvme_path and optimizer is not None and optimizer.nvme_path
                and param.nvme_path != optimizer.nvme_path):
            problems.append(f"'zero_optimization.offload_param.nvme_path' is {param.nvme_path!r} but "
                            f"offload_optimizer.nvme_path is {optimizer.nvme_path!r}: the parameter shards live in "
                            "the optimizer's swap files; leave offload_param.nvme_path unset or make them equal")
    return problems


class AioConfig(Section):
    """DeepSpeed's `aio` section: the tuning of DeepSpeed's libaio swap I/O, with DeepSpeed's defaults
    (deepspeed/runtime/swap_tensor/aio_config.py). zerodist's swap files are read and written by its
    own pread/pwrite threads (docs/offload.md), whose results do not depend on these: a section that
    checks is dropped with the info line naming it (config/deepspeed_keys.py); a value of the wrong
    type or range is refused naming its key (DeepSpeed itself reads these values without a check,
    `get_scalar_param`, and hands them to its libaio handle)."""

    block_size: int = Field(1048576, ge=1, description="Accepted for DeepSpeed compatibility (bytes per libaio "
                            "request); an integer > 0.")
    queue_depth: int = Field(8, ge=1, description="Accepted for DeepSpeed compatibility (libaio requests in "
                             "flight); an integer > 0.")
    intra_op_parallelism: int = Field(1, ge=1, description="Accepted for DeepSpeed compatibility (libaio threads "
                                      "per request); an integer > 0.")
    thread_count: int = Field(1, ge=1, description="Accepted for DeepSpeed compatibility (the older name of "
                              "intra_op_parallelism); an integer > 0.")
    single_submit: bool = Field(False, description="Accepted for DeepSpeed compatibility; true or false.")
    overlap_events: bool = Field(True, description="Accepted for DeepSpeed compatibility; true or false.")
    use_gds: bool = Field(False, description="Accepted for DeepSpeed compatibility (GPUDirect Storage); true or "
                          "false.")


def is_valid_aio_section(value: Any) -> bool:
    """Whether `value` is an `aio` section with DeepSpeed's keys and values of the types they mean."""
    try:
        AioConfig.model_validate(value)
    except ValueError:  # pydantic's ValidationError is a ValueError
        return False
    return True
