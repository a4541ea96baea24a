"""DeepSpeed's `PipelineModule`: a list of layers cut into pipeline stages, each rank building its own.

    net = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 8), nn.ReLU(), ...], num_stages=2,
                         loss_fn=nn.CrossEntropyLoss(), partition_method="parameters")
    engine, *_ = zerodist.initialize(model=net, config=...)
    loss = engine.train_batch(data_iter)

The forward is `for layer in layers: x = layer(x)` (each layer takes what the previous returned,
a tensor or a tuple, as one argument); layers are modules, `LayerSpec`s (built only by the ranks
that hold them) or any callables. No class name means anything.

[Note: pipeline state-dict keys] Each layer this rank holds is registered under its global index
(`str(index)`), exactly as `nn.Sequential(*layers)` registers it, so the union over stages of
`state_dict()` keys is `nn.Sequential(*layers).state_dict()`'s keys and a checkpoint keyed by
them loads at any pipe degree. A tied module used at indices i and j on one rank is registered
under both, as Sequential would (state_dict lists both keys, `named_parameters` the first).

[Note: a tied module's first name] A rank that holds a tied key's later layers but not its first
(the head on the last stage, tied to the embedding at index 0) registers the module under the
first layer's index as well, before its own. So `named_parameters` names it as one process does
(`0.tok_emb.weight`, not `4.tok_emb.weight`): every stage trains the tied parameter under one
name, and the checkpoint holds it once (equal copies from several stages are written once), so
it loads at any pipe degree, pipe 1 included. The extra key is one that `nn.Sequential` has too.

[Note: activation checkpoints] With `activation_checkpoint_interval=k > 0` a stage's forward in
training runs its layers in blocks of k, and a block is recomputed in the backward pass
(`activation_checkpoint_func(run_block, *inputs)`) when DeepSpeed's rule says so: every layer's
class is in `checkpointable_layers` when given, else some layer of the block has parameters. The
default function is DeepSpeed's, `deepspeed.checkpointing.checkpoint` (torch's reentrant
checkpoint); the config's `pipeline.use_reentrant: false` sets `non_reentrant_checkpoint`, and
`pipeline.activation_checkpoint_interval` > 0 sets the interval (zerodist/pipe/apply.py). Reentrant
recomputation gives a block's parameters gradients only if an input requires grad, which the first
stage's batch does not: DeepSpeed's engine marks it; here the block gets a detached copy that
requires grad (and a block whose inputs hold no floating tensor, token ids, runs under the
non-reentrant checkpoint). The gradients are those without checkpointing (tests/pipe/
test_pipe_module_checkpoint.py).

Stage placement: with `p` pipe ranks and `v = stages_per_rank`, the layers are cut into `p * v`
stages and stage s lives on pipe rank `s % p` (the schedules' "loop" placement,
`zerodist.pipe.schedule.stage_to_rank`), or, with `stage_placement="v"` and two stages per rank
(the zbv and dualpipev schedules), on ranks s and 2p - 1 - s folded into a V. The pipe axis is outermost in `Topology`, so the pipe
rank of global rank g is `g // (world_size // p)`, known before any topology exists.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

import zerodist.comm as comm
from zerodist import compat
from zerodist.pipe import checkpointing
from zerodist.pipe.schedule import stage_to_rank
from zerodist.utils import get_logger, log_rank0

__all__ = ["LayerSpec", "PartitionError", "PipelineModule", "TiedLayerSpec", "partition_balanced",
           "partition_uniform"]

logger = get_logger(__name__)


class PartitionError(ValueError):
    """The layers cannot be cut into the requested stages (too few layers, unknown method)."""


class LayerSpec:
    """A layer built later, only by the rank that holds it: `LayerSpec(nn.Linear, 8, 8)`."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, torch.nn.Module)):
            raise TypeError(f"LayerSpec only supports torch.nn.Module types, got {typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self) -> torch.nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose weights (`tied_weight_attr`, dotted names allowed) are shared by every
    `TiedLayerSpec` of the same `key`, on whichever stages they land: each such stage holds a copy,
    equal at start (broadcast from the lowest stage) and kept equal (gradients summed over the
    stages that hold it). `forward_fn(module, x)`, if given, replaces `module(x)` for this use."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable[..., Any] | None = None,
                 tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs: Any):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of `num_parts` contiguous parts of equal count (the first ones one longer)."""
    size, extra = divmod(num_items, num_parts)
    return [part * size + min(part, extra) for part in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of `num_parts` non-empty contiguous parts whose largest weight sum is smallest,
    then whose sum of squared part weights is smallest (the evenest split), then the earliest
    boundaries; by dynamic programming over (parts, prefix)."""
    n = len(weights)
    if n < num_parts:
        raise PartitionError(f"{n} layers cannot fill {num_parts} stages; use fewer stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = (float("inf"), float("inf"))
    # best[k][i]: (bottleneck, sum of squares) of the first i items in k parts; cut[k][i]: where part k starts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                part = prefix[i] - prefix[j]
                value = (max(best[k - 1][j][0], part), best[k - 1][j][1] + part * part)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [n], n
    for k in range(num_parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def _count_parameters(layer: Any) -> int:
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):  # counted without memory or time: nothing is initialised
            layer = layer.build()
    if isinstance(layer, torch.nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def _class_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__


def partition_layers(layers: Sequence[Any], num_parts: int, method: str) -> list[int]:
    """DeepSpeed's partition methods: "uniform" (equal layer counts), "parameters" (balance the
    trained parameter counts), "type:<regex>" (balance the layers whose class name matches)."""
    if len(layers) < num_parts:
        raise PartitionError(f"{len(layers)} layers cannot be cut into {num_parts} pipeline stages (every stage "
                             "needs a layer); use fewer stages or more layers")
    method = method.lower()
    if method == "uniform":
        return partition_uniform(len(layers), num_parts)
    if method == "parameters":
        weights = [float(_count_parameters(layer)) for layer in layers]
    elif method.startswith("type:"):
        pattern = re.compile(method[len("type:"):], re.IGNORECASE)
        weights = [1.0 if pattern.search(_class_name(layer)) else 0.0 for layer in layers]
        if not any(weights):
            raise PartitionError(f"partition_method {method!r} matches no layer's class name; the classes are "
                                 f"{sorted({_class_name(layer) for layer in layers})}")
    elif method == "profile":
        raise NotImplementedError("partition_method 'profile' is not implemented (nor is it in DeepSpeed)")
    else:
        raise PartitionError(f"unknown partition_method {method!r}; use 'parameters', 'uniform' or 'type:<regex>'")
    if not any(weights):  # nothing to balance (no parameters): equal counts
        return partition_uniform(len(layers), num_parts)
    return partition_balanced(weights, num_parts)


def _pipe_degree(num_stages: int | None, topology: Any) -> int:
    if topology is not None:
        size = getattr(topology, "get_dim", None)
        degree = size("pipe") if size is not None else topology.size("pipe")
        if num_stages is not None and num_stages != degree:
            raise ValueError(f"PipelineModule(num_stages={num_stages}) disagrees with the topology's pipe degree "
                             f"{degree}; give one of them")
        return int(degree)
    if num_stages is None:
        raise ValueError("PipelineModule: must provide num_stages or topology")
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"PipelineModule(num_stages=...) takes a positive int, got {num_stages!r}")
    return num_stages


def _interval(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"PipelineModule: activation_checkpoint_interval takes an int >= 0 (0: no activation "
                         f"checkpointing), got {value!r}")
    return value


class PipelineModule(torch.nn.Module):
    """`layers` cut into `num_stages` pipe ranks' stages; this rank builds and holds its own."""

    def __init__(self, layers: Iterable[Any], num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable[..., torch.Tensor] | None = None, seed_layers: bool = False,
                 seed_fn: Callable[[int], Any] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable[..., Any] | None = None,
                 checkpointable_layers: Sequence[str] | None = None, stages_per_rank: int = 1,
                 dynamic_shape: bool = False, stage_placement: str = "loop"):
        super().__init__()
        layers = list(layers)
        self.num_stages = _pipe_degree(num_stages, topology)
        if not isinstance(stages_per_rank, int) or stages_per_rank < 1:
            raise ValueError(f"PipelineModule(stages_per_rank=...) takes a positive int, got {stages_per_rank!r}")
        self.stages_per_rank = stages_per_rank
        self.total_stages = self.num_stages * stages_per_rank
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.activation_checkpoint_interval = _interval(activation_checkpoint_interval)
        # DeepSpeed's default: its reentrant `checkpointing.checkpoint` ([Note: activation checkpoints])
        self.activation_checkpoint_func = activation_checkpoint_func or checkpointing.checkpoint
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, (list, tuple)):
            raise TypeError("PipelineModule(checkpointable_layers=...) takes a list of layer class names, got "
                            f"{type(checkpointable_layers).__name__}")
        self.checkpointable_layers = None if checkpointable_layers is None else list(checkpointable_layers)
        # Every message carries its tensors' shapes ([Note: p2p headers]): shapes may change between
        # batches whatever this says; kept for DeepSpeed's scripts, which read it back.
        self.dynamic_shape = bool(dynamic_shape)
        self._checkpointable_cache: dict[tuple[int, int], list[bool]] = {}
        self.num_layers = len(layers)
        self.layer_classes = [_class_name(layer) for layer in layers]  # every rank's, for agreement checks
        self.parts = self._partition(layers, partition_method)
        # One stage needs no world (a module built in a plain script or test); more need the ranks.
        world = 1 if self.num_stages == 1 and not comm.is_initialized() else comm.get_world_size()
        if world % self.num_stages:
            raise ValueError(f"PipelineModule(num_stages={self.num_stages}) does not divide the world size {world}")
        rank = comm.get_rank() if world > 1 else 0
        self.stage_id = rank // (world // self.num_stages)  # the pipe axis is outermost
        if stage_placement not in ("loop", "v") or (stage_placement == "v" and stages_per_rank != 2):
            raise ValueError(f"PipelineModule(stage_placement={stage_placement!r}) takes 'loop' or, with "
                             "stages_per_rank=2, 'v' (the zbv and dualpipev schedules' placement)")
        self.stage_placement = stage_placement  # which rank holds which stage: schedule.stage_to_rank
        self.local_stages = sorted(s for s in range(self.total_stages)
                                   if stage_to_rank(s, self.num_stages, stage_placement) == self.stage_id)
        self.tied_keys: dict[str, list[int]] = {}  # key -> global stages that hold it
        self._tied_attrs: dict[str, list[str]] = {}
        self._tied_modules: dict[str, torch.nn.Module] = {}
        self._forward_funcs: dict[int, Callable[..., Any]] = {}
        self._build(layers, seed_layers, seed_fn or torch.manual_seed, base_seed)

    # ------------------------------------------------------------------ building
    def _partition(self, layers: Sequence[Any], partition_method: str) -> list[int]:
        """The stage boundaries (`parts`) of `layers`; a subclass that knows its cuts returns them."""
        return partition_layers(layers, self.total_stages, partition_method)

    def stage_modules(self, stage: int) -> list[torch.nn.Module]:
        """The modules that hold the parameters of `stage` (a weight-gradient action runs over them)."""
        found = (compat.registered_child(self, str(index)) for index in self.stage_layers(stage))
        return [module for module in found if module is not None]

    def stage_of_layer(self, index: int) -> int:
        for stage in range(self.total_stages):
            if self.parts[stage] <= index < self.parts[stage + 1]:
                return stage
        raise IndexError(f"layer {index} is not in this pipeline's {self.num_layers} layers")

    def stage_layers(self, stage: int) -> range:
        """The global indices of the layers of `stage`."""
        return range(self.parts[stage], self.parts[stage + 1])

    def _build(self, layers: list[Any], seed_layers: bool, seed_fn: Callable[[int], Any], base_seed: int) -> None:
        local = {index for stage in self.local_stages for index in self.stage_layers(stage)}
        first_index: dict[str, int] = {}  # tied key -> its first layer ([Note: a tied module's first name])
        for index, layer in enumerate(layers):
            if isinstance(layer, TiedLayerSpec):
                first_index.setdefault(layer.key, index)
        for index, layer in enumerate(layers):
            if isinstance(layer, TiedLayerSpec):
                self.tied_keys.setdefault(layer.key, [])
                stage = self.stage_of_layer(index)
                if stage not in self.tied_keys[layer.key]:
                    self.tied_keys[layer.key].append(stage)
                self._tied_attrs[layer.key] = layer.tied_weight_attr
            if index not in local:
                continue
            if seed_layers:
                seed_fn(base_seed + index)
            # Modules are looked up by name when run (`_run`), so a technique that swaps a layer for its
            # parallel form (tensor parallelism) is what runs.
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self._tied_modules:
                    self._tied_modules[layer.key] = layer.build()
                    # Registered first under the key's first index, so that every stage trains it (and
                    # a checkpoint names it) under the name it has in one process.
                    self.add_module(str(first_index[layer.key]), self._tied_modules[layer.key])
                self.add_module(str(index), self._tied_modules[layer.key])
                if layer.forward_fn is not None:
                    self._forward_funcs[index] = layer.forward_fn
            elif isinstance(layer, LayerSpec):
                self.add_module(str(index), layer.build())
            elif isinstance(layer, torch.nn.Module):
                self.add_module(str(index), layer)
            elif callable(layer):
                self._forward_funcs[index] = layer
            else:
                raise TypeError(f"PipelineModule: layer {index} is a {type(layer).__name__}, not a module, a "
                                "LayerSpec or a callable")

    # ------------------------------------------------------------------ running
    def forward(self, inputs: Any, stage: int | None = None) -> Any:
        """Run the layers of `stage` (default: this rank's only stage) on `inputs`."""
        if stage is None:
            if len(self.local_stages) != 1:
                raise ValueError(f"this rank holds stages {self.local_stages}: name the one to run")
            stage = self.local_stages[0]
        if stage not in self.local_stages:
            raise ValueError(f"stage {stage} is not on this rank (it holds {self.local_stages})")
        indices = list(self.stage_layers(stage))
        interval = self.activation_checkpoint_interval
        if not interval or not torch.is_grad_enabled():
            return self._run(indices, inputs)
        for block, checkpointed in zip(range(0, len(indices), interval), self._checkpointable_blocks(stage)):
            chunk = indices[block:block + interval]
            if checkpointed:
                inputs = self._run_checkpointed(chunk, inputs)
            else:
                inputs = self._run(chunk, inputs)
        return inputs

    def _run_checkpointed(self, chunk: Sequence[int], inputs: Any) -> Any:
        """`chunk` under `activation_checkpoint_func` ([Note: activation checkpoints])."""
        was_tuple = isinstance(inputs, tuple)
        args = list(inputs) if was_tuple else [inputs]
        function = self.activation_checkpoint_func
        run = functools.partial(self._run_unpacked, chunk, was_tuple)
        if function is checkpointing.checkpoint and not any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            floating = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
            if not floating:  # reentrant recomputation would give the chunk's parameters no gradient
                return checkpointing.non_reentrant_checkpoint(run, *args)
            for i in floating:
                args[i] = args[i].detach().requires_grad_(True)
        return function(run, *args)

    def _run(self, indices: Sequence[int], inputs: Any) -> Any:
        for index in indices:
            module = compat.registered_child(self, str(index))
            function = self._forward_funcs.get(index)
            if module is None:
                inputs = function(inputs)  # type: ignore[misc]  # a plain callable layer
            elif function is not None:
                inputs = function(module, inputs)  # a tied layer's forward_fn
            else:
                inputs = module(inputs)
        return inputs

    def _run_unpacked(self, indices: Sequence[int], was_tuple: bool, *inputs: Any) -> Any:
        return self._run(indices, inputs if was_tuple else inputs[0])

    # ------------------------------------------------------------------ activation checkpoints
    def _layer(self, index: int) -> Any:
        module = compat.registered_child(self, str(index))
        return module if module is not None else self._forward_funcs.get(index)

    def _is_checkpointable(self, layers: Sequence[Any]) -> bool:
        """DeepSpeed's rule: with `checkpointable_layers`, a block every layer of which is one of those
        classes; without, a block with a layer that has parameters."""
        if self.checkpointable_layers is not None:
            return all(type(layer).__name__ in self.checkpointable_layers for layer in layers)
        return any(isinstance(layer, torch.nn.Module) and any(True for _ in layer.parameters()) for layer in layers)

    def _checkpointable_blocks(self, stage: int) -> list[bool]:
        """Whether each block of `activation_checkpoint_interval` layers of `stage` is checkpointed."""
        interval = self.activation_checkpoint_interval
        key = (stage, interval)
        if key not in self._checkpointable_cache:
            indices = list(self.stage_layers(stage))
            self._checkpointable_cache[key] = [
                self._is_checkpointable([self._layer(i) for i in indices[start:start + interval]])
                for start in range(0, len(indices), interval)]
        return self._checkpointable_cache[key]

    def _precompute_checkpointable_values(self) -> None:
        """DeepSpeed's name: work out which blocks are checkpointed at the current interval."""
        if self.activation_checkpoint_interval > 0:
            for stage in self.local_stages:
                self._checkpointable_blocks(stage)

    @property
    def is_checkpointable_results(self) -> list[bool]:
        """DeepSpeed's list: for each block of this rank's layers, whether it is checkpointed (empty
        when the interval is 0)."""
        if not self.activation_checkpoint_interval:
            return []
        return [result for stage in self.local_stages for result in self._checkpointable_blocks(stage)]

    def configure_checkpointing(self, interval: int, use_reentrant: bool | None) -> None:
        """DeepSpeed's "pipeline" section, as its engine applies it: `use_reentrant=False` picks the
        non-reentrant function (whatever the interval), an interval > 0 replaces the module's."""
        if use_reentrant is False:
            self.activation_checkpoint_func = checkpointing.non_reentrant_checkpoint
            log_rank0(logger, "config: pipeline.use_reentrant=false: activation_checkpoint_func=non_reentrant_checkpoint")
        if interval > 0:
            self.activation_checkpoint_interval = _interval(interval)
        self._precompute_checkpointable_values()

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint every `interval` layers of a stage's forward from now on (0: none)."""
        self.activation_checkpoint_interval = _interval(interval)
        self._precompute_checkpointable_values()

    # ------------------------------------------------------------------ tied layers
    def tied_parameters(self) -> dict[str, list[torch.nn.Parameter]]:
        """The tied parameters this rank holds, by key: every trained parameter of the key's module.

        The layers of one key share one module (as `nn.Sequential` given the same module twice
        would), so every copy of all its parameters is kept equal, not only `tied_weight_attr`'s
        (DeepSpeed reduces only those, and lets the copies' other parameters drift apart).
        `tied_weight_attr` is checked to name parameters of the module."""
        result: dict[str, list[torch.nn.Parameter]] = {}
        for key, module in self._tied_modules.items():
            for attr in self._tied_attrs[key]:
                value: Any = module
                for part in attr.split("."):
                    value = getattr(value, part, None)
                if not isinstance(value, torch.nn.Parameter):
                    raise AttributeError(f"TiedLayerSpec({key!r}): tied_weight_attr {attr!r} is not a parameter "
                                         f"of {type(module).__name__}")
            result[key] = [p for p in module.parameters() if p.requires_grad]
        return result

    def tied_module(self, key: str) -> torch.nn.Module:
        """The module this rank holds for tied `key` (one object, however many of its layers use it)."""
        return self._tied_modules[key]

    def is_first_stage(self, stage: int) -> bool:
        return stage == 0

    def is_last_stage(self, stage: int) -> bool:
        return stage == self.total_stages - 1

    def extra_repr(self) -> str:
        return (f"stages={self.total_stages} ({self.num_stages} pipe ranks x {self.stages_per_rank}), "
                f"this rank's stages={self.local_stages}, parts={self.parts}")
