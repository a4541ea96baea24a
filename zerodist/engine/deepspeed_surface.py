"""DeepSpeed's engine accessors, so a script written for `DeepSpeedEngine` runs on the `Engine`.

DeepSpeed scripts query the engine through small methods (`engine.train_batch_size()`,
`engine.fp16_enabled()`, `engine.zero_optimization_stage()`) and attributes (`local_rank`,
`global_rank`, `world_size`, `device`, `global_samples`). They live here, apart from the
training step, so `engine.py` stays about what the engine does; each one reads state the engine
already has and adds none (docs/deepspeed.md lists them with DeepSpeed's meanings).

The attribute look-up fall-through (`engine.fc1` is `engine.module.fc1`) is DeepSpeed's too: an
attribute the engine does not have is looked up on the wrapped model, read-only.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch

import zerodist.comm as comm
from zerodist import compat
from zerodist.utils import get_logger

logger = get_logger(__name__)

# The engine built last, for `deepspeed.utils.groups` (DeepSpeed's groups are process-wide, set by the
# engine it built last too); weak, so it keeps no engine alive.
_LATEST: weakref.ref[Any] | None = None


# Every engine alive in this process, for DeepSpeed's per-parameter accessors (deepspeed_tensors.py),
# in the order they were built: engines are built collectively, so this order is the same on every
# rank (a WeakSet's is not: it follows the objects' addresses). Weak, so it keeps no engine alive.
_ENGINES: list[weakref.ref[Any]] = []
_BUILT = itertools.count()  # each engine's serial number: the same on every rank (building is collective)


def live_engines() -> list[Any]:
    """The engines `initialize()` built in this process that are alive and not destroyed, oldest first."""
    _ENGINES[:] = [ref for ref in _ENGINES if ref() is not None]
    return [engine for ref in _ENGINES if (engine := ref()) is not None]


def latest_engine() -> Any:
    """The engine `initialize()` built last in this process with process groups of its own (see
    `_sets_process_groups`) and still alive and not destroyed, or None."""
    return _LATEST() if _LATEST is not None else None


def _sets_process_groups(engine: Any) -> bool:
    """Whether `engine` is the one `deepspeed.utils.groups` answers from: DeepSpeed's engine sets its
    process-wide groups (`groups.mesh_device`, `groups.mpu`) only when it has a mesh or an mpu, so a
    later plain engine (TRL's reference model) leaves them alone. Here: a mesh or mpu request
    (sequence method 'manual'), or sequence, tensor or pipeline parallelism (DeepSpeed's pipeline
    engine has its module's mpu)."""
    topology = engine.topology
    return engine.config.zerodist.sequence_parallel.method == "manual" or any(
        topology.size(*axes) > 1 for axes in (topology.sequence_axes, topology.tensor_axes, topology.pipe_axes))


class DeepSpeedEngineAPI:
    """Mixed into `Engine` (an `nn.Module`); expects its `module`, `config`, `batch`, `stage`,
    `global_steps`, `last_step` and `policy`."""

    module: torch.nn.Module
    # Set by `Engine.__init__` through `_record_world()`: DeepSpeed's plain attributes.
    local_rank: int
    global_rank: int
    world_size: int
    device: torch.device

    def _record_world(self) -> None:
        info = comm.ensure_initialized()
        self.local_rank = info.local_rank
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self.device = comm.device_for_rank()
        # DeepSpeed's engine reports this rank's step as applied only after an optimizer step
        # that was not skipped; False before the first one and after every non-boundary step().
        self._step_applied = False
        self._coalescing = False  # inside coalesce_grad_reduction()
        self._serial = next(_BUILT)  # names this engine alike on every rank (DeepSpeed's accessors' agreement)
        _ENGINES.append(weakref.ref(self))
        if _sets_process_groups(self):
            global _LATEST
            _LATEST = weakref.ref(self)

    def _forget_process_groups(self) -> None:
        """At `destroy()`: `deepspeed.utils.groups` stops answering from this engine."""
        global _LATEST
        _ENGINES[:] = [ref for ref in _ENGINES if ref() is not self]
        if latest_engine() is self:
            _LATEST = None

    # ------------------------------------------------------------------ batch sizes
    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.batch.train_batch_size  # type: ignore[attr-defined]

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per rank in one forward and backward."""
        return self.batch.micro_batch_size  # type: ignore[attr-defined]

    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step (a method, as in DeepSpeed)."""
        return self.batch.gradient_accumulation_steps  # type: ignore[attr-defined]

    @property
    def global_samples(self) -> int:
        """Samples consumed by all ranks so far: DeepSpeed adds `train_batch_size()` at every
        optimizer step (skipped ones included), so this is that product; read-only here."""
        return self.global_steps * self.train_batch_size()  # type: ignore[attr-defined]

    @property
    def dp_world_size(self) -> int:
        """Ranks that each see different samples (the data-parallel degree, DeepSpeed's attribute)."""
        return self.topology.num_batch_shards  # type: ignore[attr-defined]

    @property
    def mp_world_size(self) -> int:
        """The model-parallel (tensor) degree."""
        return self.topology.size(*self.topology.tensor_axes)  # type: ignore[attr-defined]

    @property
    def checkpoint_mp_rank(self) -> int:
        """This rank's index in its model-parallel (tensor) group; 0 without one (DeepSpeed's attribute)."""
        return self.topology.axis_rank(*self.topology.tensor_axes)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ DeepSpeed's process groups
    @property
    def sequence_parallel_size(self) -> int:
        return self.topology.size(*self.topology.sequence_axes)  # type: ignore[attr-defined]

    @property
    def seq_parallel_group(self) -> Any:
        """The ranks that split each sample's sequence with this one (one rank without sequence parallelism)."""
        return self.topology.group(*self.topology.sequence_axes)  # type: ignore[attr-defined]

    def get_sequence_parallel_group(self) -> Any:
        return self.seq_parallel_group

    @property
    def data_parallel_group(self) -> Any:
        """The ranks that see other samples (`dp_world_size` of them)."""
        return self.topology.group(*self.topology.batch_axes)  # type: ignore[attr-defined]

    @property
    def seq_data_parallel_group(self) -> Any:
        """Data x sequence: where DeepSpeed (and ZeRO here) reduces the gradients of dense parameters."""
        topology = self.topology  # type: ignore[attr-defined]
        return topology.group(*topology.batch_axes, *topology.sequence_axes)

    @property
    def seq_dp_world_size(self) -> int:
        topology = self.topology  # type: ignore[attr-defined]
        return topology.size(*topology.batch_axes, *topology.sequence_axes)

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """DeepSpeed's block for one optimizer step's several `backward()` calls (stages 1-3): the
        `step()` after it applies the sum of the block's gradients averaged over the ranks. Stage 1:
        each backward inside only accumulates locally (as `no_sync()`) and leaving the block reduces
        once, at the accumulation boundary (a block on an earlier micro-step leaves its sum to the
        boundary's reduction). Stages 2-3 reduce each bucket into the fp32 shards as it fills, as
        always (the same sum; DeepSpeed's single flush of a bf16 local sum would round more and
        keep full-size gradient buffers). DeepSpeed's checks: stage 0 and a pipeline are refused,
        it does not nest with `no_sync()` (either way), and `step()` inside raises. An exception
        inside the block ends it without the reduction (no collective on an error path)."""
        stage = self.stage  # type: ignore[attr-defined]
        if stage not in (1, 2, 3):
            raise NotImplementedError(f"coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage {stage}")
        if self.pipeline is not None:  # type: ignore[attr-defined]
            raise NotImplementedError("coalesce_grad_reduction is not supported under pipeline parallelism")
        if self._no_sync or self._coalescing:  # type: ignore[attr-defined]
            raise AssertionError("coalesce_grad_reduction cannot be nested inside another no_sync context")
        self._coalescing = True  # stage 1: engine._backward does not sync (as under no_sync())
        try:
            yield
        finally:
            self._coalescing = False
        # Reached only when the block ended normally: every rank reduces, in the reducer's fixed order.
        if not self.sharding.shard_gradients and self.is_gradient_accumulation_boundary():  # type: ignore[attr-defined]
            self.reducer.reduce_accumulated()  # type: ignore[attr-defined]

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: free the memory held for gathered parameters between uses. Here: finish the
        last step's gathers and release stage 3's idle pooled gather buffers (they are made again
        on the next gather). Collective here (finishing the gathers waits on them): call it on every
        rank alike."""
        self.units.finish_gathers(release=True)  # type: ignore[attr-defined]
        for group in self.groups:  # type: ignore[attr-defined]
            group.release_pooled_buffers()

    def was_step_applied(self) -> bool:
        """Whether the latest `step()` updated the parameters: False between accumulation
        boundaries and when an fp16 overflow skipped the step."""
        return self._step_applied

    # ------------------------------------------------------------------ what the config chose
    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled  # type: ignore[attr-defined]

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled  # type: ignore[attr-defined]

    def amp_enabled(self) -> bool:
        """Always False: apex AMP is not part of zerodist (the `amp` config key is refused)."""
        return False

    def zero_optimization(self) -> bool:
        """Whether any ZeRO stage above 0 is on (DeepSpeed's meaning)."""
        return self.sharding.shard_optimizer_state  # type: ignore[attr-defined]

    def zero_optimization_stage(self) -> int:
        return self.stage  # type: ignore[attr-defined]

    def zero_optimization_partition_gradients(self) -> bool:
        return self.sharding.shard_gradients  # type: ignore[attr-defined]

    def zero_optimization_partition_weights(self) -> bool:
        return self.sharding.shard_parameters  # type: ignore[attr-defined]

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping  # type: ignore[attr-defined]

    def steps_per_print(self) -> int:
        return self.config.steps_per_print  # type: ignore[attr-defined]

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown  # type: ignore[attr-defined]

    def dynamic_loss_scale(self) -> bool:
        """fp16 with `loss_scale` 0: the scale adapts to overflows."""
        return self.fp16_enabled() and self.config.fp16.loss_scale == 0  # type: ignore[attr-defined]

    def optimizer_name(self) -> str | None:
        """The config's optimizer `type`, None when the script passed its own optimizer."""
        section = self.config.optimizer  # type: ignore[attr-defined]
        return None if section is None else section.type

    def scheduler_name(self) -> str | None:
        section = self.config.scheduler  # type: ignore[attr-defined]
        return None if section is None else section.type

    # ------------------------------------------------------------------ whole weights, as the HF stack asks for them
    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's `stage3_gather_16bit_weights_on_model_save` (accelerate's `get_state_dict` asks)."""
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)  # type: ignore[attr-defined]

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's name for the model's whole `state_dict()` in the training dtype, on rank 0 (None
        elsewhere); every rank must call it (gathered one unit at a time at stage 3)."""
        state = self.module_state_dict(rank0_only=True)  # type: ignore[attr-defined]
        if state is not None and exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
            state = {name: value for name, value in state.items() if name not in frozen}
        return state

    # ------------------------------------------------------------------ attributes of the model
    def __getattr__(self, name: str) -> Any:
        # Called only when normal look-up failed: nn.Module's parameters, buffers and
        # submodules first, then the wrapped model's attributes (DeepSpeed's fall-through).
        try:
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            pass
        module = compat.registered_child(self, "module")
        if module is None:  # still in __init__, before the model is registered
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        try:
            return getattr(module, name)
        except AttributeError:
            pass
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}', and neither has "
                             f"the model it wraps ({type(module).__name__})")
