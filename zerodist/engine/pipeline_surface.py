"""DeepSpeed's ``PipelineEngine`` accessors on zerodist's pipeline engine: ``set_dataiterator``,
``stage_id``, ``num_stages``, ``grid``; and DeepSpeed's order for the data ``train_batch()`` reads itself.

Kept apart from engine/pipeline.py (what the pipeline engine does) as deepspeed_surface.py is from
engine.py: each member reads state the engine already has.

[Note: the pipeline engine's own data order]
DeepSpeed's pipeline engine reads ``initialize(training_data=...)`` through
``DistributedSampler(shuffle=False)`` repeated (``RepeatingLoader``): the same order every epoch, in
dataset order. zerodist's plain engine reshuffles every epoch (engine/dataloader.py). A pipeline
script that lets ``train_batch()`` read the data (no ``data_iter``) expects DeepSpeed's samples, so
the pipeline engine turns its own loader's shuffling off when it first reads from it; the loader
is zerodist's, made by ``initialize``, never the user's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from zerodist.engine.dataloader import EngineDataLoader
from zerodist.pipe import checkpointing
from zerodist.utils import RepeatingLoader


class PipelineGridView:
    """``engine.grid``: DeepSpeed's ``PipelineParallelGrid`` queries answered from the engine's topology
    (its process groups are the engine's own; no group is created)."""

    def __init__(self, engine: Any) -> None:
        self._topology, self._num_stages = engine.topology, engine.num_stages

    def get_stage_id(self) -> int:
        return int(self._topology.axis_rank("pipe"))

    get_pipe_parallel_rank = get_stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return int(self._num_stages)

    def get_pipe_parallel_group(self) -> Any:
        return self._topology.group("pipe")

    def get_data_parallel_rank(self) -> int:
        return int(self._topology.axis_rank(*self._batch_axes()))

    def get_data_parallel_world_size(self) -> int:
        return int(self._topology.size(*self._batch_axes()))

    def get_data_parallel_group(self) -> Any:
        return self._topology.group(*self._batch_axes())

    def _batch_axes(self) -> tuple[str, ...]:
        return tuple(a for a in ("data", "expert") if a in self._topology.degrees)

    @property
    def is_first_stage(self) -> bool:
        return self.get_stage_id() == 0

    @property
    def is_last_stage(self) -> bool:
        return self.get_stage_id() == self._num_stages - 1

    def stage_to_global(self, stage_id: int) -> int:
        """The global rank holding `stage_id` at this rank's place on the other axes."""
        return int(self._topology.ranks("pipe")[stage_id])


class PipelineEngineSurface:
    """Mixed into ``Engine`` (one class for every model, zerodist/engine/pipeline.py); expects its
    ``pipeline`` (a ``PipelineState``, or None without a pipeline), ``topology``,
    ``training_dataloader`` and ``own_data_iter``. Without a pipeline the engine is one stage."""

    pipeline: Any
    topology: Any
    training_dataloader: Any
    own_data_iter: Iterator[Any] | None

    @property
    def stage_id(self) -> int:
        """This rank's pipeline stage."""
        return 0 if self.pipeline is None else int(self.pipeline.pipe_rank)

    @property
    def num_stages(self) -> int:
        return 1 if self.pipeline is None else int(self.pipeline.module.num_stages)

    @property
    def grid(self) -> PipelineGridView:
        return PipelineGridView(self)

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator ``train_batch()`` / ``eval_batch()`` read when called without ``data_iter``
        (DeepSpeed's; under a pipeline only the first and last stages read)."""
        self.own_data_iter = iterator

    def _reentrant_activation_checkpointing(self) -> bool:
        """DeepSpeed's (private, read by its tests): whether the PipelineModule checkpoints activations
        with the reentrant function (zerodist/pipe/module.py, [Note: activation checkpoints])."""
        module = None if self.pipeline is None else self.pipeline.module
        if module is None or module.activation_checkpoint_interval <= 0:
            return False
        return module.activation_checkpoint_func is not checkpointing.non_reentrant_checkpoint

    def deepspeed_order_iterator(self) -> Iterator[Any]:
        """The engine's own loader, repeated; under a pipeline in DeepSpeed's order ([Note: the pipeline
        engine's own data order])."""
        loader = self.training_dataloader
        if self.pipeline is not None and isinstance(loader, EngineDataLoader):
            loader.sampler.shuffle = False
        return iter(RepeatingLoader(loader))
