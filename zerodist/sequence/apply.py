"""`apply_sequence_parallel`: the engine's front door to sequence parallelism, one part at a time.

With `sequence_parallel_size` = P > 1 the engine's topology has a `sequence` axis of degree P, and
for each part this:
1. gives the sequence group (and method, layout) to the model's attention: every
   `DistributedAttention` built with `sequence_process_group=None` (the demo GPT's), or, for a
   Hugging Face model, the function registered in transformers' attention registry, selected with
   the model's own `set_attn_implementation` (undone by `remove_hooks`);
2. checks at configuration time what would otherwise fail later: heads the degree does not divide
   (Ulysses; the ring is the hint), counting the heads this rank holds under tensor parallelism;
3. registers two hooks on the part's root module (torch's API; nothing written on the module):
   before forward, the call must carry `position_ids` and, where it has `labels`, the
   `shift_labels` made before the split (zerodist/sequence/data.py); after forward, the loss the
   model returned (a scalar, or `.loss`) becomes the token-weighted mean over the whole sequence
   (zerodist/sequence/loss.py).
ZeRO then shards and reduces dense parameters over data x sequence (`DENSE` in
comm/topology.py), and the gradient divisor stays data x expert ([Note: sequence gradients]).
With `method: "manual"` (DeepSpeed's manual mode, [Note: DeepSpeed's manual sequence parallelism]
in engine/deepspeed_args.py) only the group is kept: steps 1-3 are the script's.

[Note: sequence x tensor] Tensor parallelism runs first (engine/initialize.py) and gives each
tensor rank H/t query heads and H_kv/t key/value heads; the attention then runs sequence-parallel
over the `sequence` group of ranks that share this rank's tensor index, on those local heads only:
Ulysses all-to-alls them ((H/t) % P == 0; key/value heads replicated up to P as for GQA), the
ring rotates this tensor rank's own heads' K/V. Nothing else changes: the tensor layers see the
rank's slice of the sequence as a shorter batch of tokens, the loss is the token-weighted mean
over the sequence group (every tensor rank computes the same one from its gathered logits), and
ZeRO reduces each parameter (a tensor slice or a replicated one) over data x sequence among the
ranks holding the same tensor index.

[Note: sequence x pipe] With a pipeline (a model cut by `zerodist.pipe.split_model`) every stage of
this rank holds the rank's slice of each sequence, so the messages between stages are slices
(the local sequence length) and nothing of the pipeline changes. The engine hands over the stage
module (`stages`, a `StageModule`); through it the stage glue numbers each slice's tokens by their
places in the whole sequence (position ids, rotary embeddings, learned positions) and the last
stage's `loss_fn` becomes the token-weighted mean over the sequence group. The attention is wired
on the model the stages were cut from (its `DistributedAttention` modules, or its Hugging Face
attention implementation). The pipeline's runner slices each micro-batch `(inputs, labels)` of
whole sequences (`local_micro_batch`, shapes agreed over the sequence group first) instead of the
root module's hooks (a stage's forward takes hidden states, not the model's arguments). A
`PipelineModule` built from layer specs numbers its own tokens, so it is refused by name.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch

import zerodist.comm as comm
from zerodist.comm import Group
from zerodist.comm.parts import Part
from zerodist.config import Config
from zerodist.comm.topology import Topology
from zerodist.sequence import hf
from zerodist.sequence.agreement import agree_call_shapes
from zerodist.sequence.data import shard_batch
from zerodist.sequence.errors import SequenceParallelError
from zerodist.sequence.layer import DistributedAttention, EngineSequence, register_engine_sequence
from zerodist.sequence.layout import METHODS, SequenceLayout, check_heads
from zerodist.sequence.loss import token_weighted_mean

LABEL_ARGUMENTS = ("shift_labels", "targets", "labels")  # the first present is the slice's labels


@dataclasses.dataclass(frozen=True)
class SequenceSettings:
    """The config's `sequence_parallel_size` and `zerodist.sequence_parallel.method`."""

    degree: int = 1
    method: str = "ulysses"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SequenceParallelError(f"unknown sequence-parallel method {self.method!r}; choose one of {METHODS}")

    @classmethod
    def from_config(cls, config: Config) -> SequenceSettings:
        return cls(config.sequence_parallel_size, config.zerodist.sequence_parallel.method)


class StageModule(Protocol):
    """What sequence parallelism uses of a pipeline's stage module (`zerodist.pipe.SplitPipelineModule`;
    described here, not imported: pipe/ sits beside sequence/). [Note: sequence x pipe]"""

    loss_fn: Any

    def source_model(self) -> torch.nn.Module: ...

    def shard_sequence(self, positions_of: Callable[[int], torch.Tensor] | None,
                       weigh_loss: Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]] | None) -> None:
        ...


class SequenceParallelState:
    """What `apply_sequence_parallel` did to one part (the part-state surface of comm/parts.py).
    Names and shapes are the model's own, so `to_logical` / `from_logical` change nothing."""

    def __init__(self, module: torch.nn.Module, settings: SequenceSettings, layout: SequenceLayout) -> None:
        self.module, self.settings, self.layout = module, settings, layout
        self.attention_modules: list[torch.nn.Module] = []
        self.hf_previous: str | None = None  # the attention implementation to restore
        self.wired: torch.nn.Module = module  # the model whose attention was wired (a pipeline's: its source)
        self.stages: StageModule | None = None  # a pipeline's stage module ([Note: sequence x pipe])
        self.group: Group | None = None
        self.handles: list[Any] = []

    @property
    def shards_batches(self) -> bool:
        """Whether the engine's data loader hands each sequence rank its slice (not in the manual mode,
        where the script does)."""
        return self.layout.size > 1 and self.settings.method != "manual"

    def local_micro_batch(self, inputs: Any, labels: Any) -> tuple[Any, Any]:
        """A pipeline's micro-batch of whole sequences (token ids and labels, (batch, seq)): this
        rank's slice of both, their shapes agreed over the sequence group first (every rank of a
        sequence group is on the same stage, so all of them call this). [Note: sequence x pipe]
        In DeepSpeed's manual mode the script already hands each rank its slice (DeepSpeed's
        PipelineEngine never sees the mesh): the micro-batch goes through as it is."""
        if not self.shards_batches:
            return inputs, labels
        assert self.group is not None
        tensors = [t for t in (inputs, labels) if isinstance(t, torch.Tensor)]
        agree_call_shapes(tensors, self.group, "a pipeline micro-batch's (inputs, labels)", comm.device_for_rank())
        if not (isinstance(inputs, torch.Tensor) and inputs.dim() == 2):
            raise SequenceParallelError(f"under sequence parallelism a pipeline micro-batch's inputs are (batch, seq) "
                                        f"token ids, got {type(inputs).__name__} "
                                        f"{tuple(getattr(inputs, 'shape', ()))}")
        sliced = shard_batch((inputs, labels), self.layout)
        return sliced[0], sliced[1]

    def to_logical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def from_logical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def report(self) -> list[str]:
        if self.settings.degree == 1:
            return []
        where = (f"Hugging Face attention '{hf.ATTENTION_NAME}'" if self.hf_previous is not None
                 else f"{len(self.attention_modules)} DistributedAttention module(s)")
        layout = "head-tail chunks" if self.layout.head_tail else "contiguous slices"
        return [f"sequence parallel: {self.settings.method} over {self.settings.degree} ranks, {where}, {layout}"]

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for module in self.attention_modules:
            register_engine_sequence(module, None)
        if self.stages is not None:
            self.stages.shard_sequence(None, None)
            self.stages = None
        if self.hf_previous is not None:
            self.wired.set_attn_implementation(self.hf_previous)  # type: ignore[operator]
            self.hf_previous = None
            hf.unregister_attention()


def apply_sequence_parallel(part: Part, topology: Topology, settings: SequenceSettings,
                            stages: StageModule | None = None) -> SequenceParallelState:
    """Make `part` sequence-parallel over the topology's sequence axis (nothing at degree 1).
    `stages`: the part's module when it is a pipeline's stage module that `split_model` cut
    ([Note: sequence x pipe])."""
    degree = topology.size(*topology.sequence_axes)
    if degree != settings.degree:
        raise SequenceParallelError(f"the topology's sequence degree is {degree} but the settings ask for "
                                    f"{settings.degree}")
    layout = SequenceLayout(topology.axis_rank(*topology.sequence_axes), degree, head_tail=settings.method == "ring")
    state = SequenceParallelState(part.module, settings, layout)
    if degree == 1:
        return state
    if settings.method == "manual":  # [Note: DeepSpeed's manual sequence parallelism] in engine/deepspeed_args.py
        state.group = topology.group(*topology.sequence_axes)
        return state
    if topology.size(*topology.pipe_axes) > 1:
        _apply_to_stages(stages, topology, settings, state)
        return state
    model = part.module
    _check_model_heads(model, settings, topology.size(*topology.tensor_axes))
    engine = EngineSequence(topology.group(*topology.sequence_axes), settings.method, layout, shapes_agreed=True)
    _wire_attention(model, engine, state)
    # [Note: sequence shape agreement] in zerodist/sequence/agreement.py: once per forward, not per layer,
    # and first (a call that one rank refuses below has shapes its peers do not share)
    state.handles.append(model.register_forward_pre_hook(_agree_call(engine.group), with_kwargs=True))
    state.handles.append(model.register_forward_pre_hook(_check_call, with_kwargs=True))
    state.handles.append(model.register_forward_hook(_weighted_loss(engine.group), with_kwargs=True))
    return state


def _apply_to_stages(stages: StageModule | None, topology: Topology, settings: SequenceSettings,
                     state: SequenceParallelState) -> None:
    """[Note: sequence x pipe]: the source model's attention over the sequence group, the stages'
    token numbering and loss. Refusals first, alike on every rank (they depend on the model only)."""
    if stages is None:
        raise SequenceParallelError(
            "sequence_parallel_size > 1 with a PipelineModule built from layers: its layers number their own tokens "
            "(positions from 0), which a slice of the sequence cannot do. Cut the model with "
            "zerodist.pipe.split_model(model, ...), whose stages number each slice's tokens, or use one of the two")
    if stages.loss_fn is None:
        raise SequenceParallelError("sequence_parallel_size > 1 with a pipeline needs the stages' loss_fn (the loss "
                                    "becomes the token-weighted mean over the sequence group): give split_model one")
    source = stages.source_model()
    _check_model_heads(source, settings, topology.size(*topology.tensor_axes))
    group = topology.group(*topology.sequence_axes)
    # shapes are agreed once per micro-batch, in local_micro_batch (a stage's forward takes hidden states)
    engine = EngineSequence(group, settings.method, state.layout, shapes_agreed=True)
    state.wired, state.group = source, group
    _wire_attention(source, engine, state)
    layout, degree = state.layout, settings.degree
    state.stages = stages
    stages.shard_sequence(lambda length: layout.token_indices(length * degree), _weigh_loss(group))


def _weigh_loss(group: Group) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    def weigh(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
            return token_weighted_mean(loss_fn(output, labels), labels, group)
        return loss
    return weigh


def _check_model_heads(model: torch.nn.Module, settings: SequenceSettings, tensor: int) -> None:
    """Ulysses splits the heads a rank holds: all of them, or with tensor parallelism of degree t
    its H/t query and H_kv/t key/value heads ([Note: sequence x tensor])."""
    if settings.method != "ulysses":
        return
    heads = hf.hf_heads(model)
    if heads is None:
        config = getattr(model, "config", None)
        n_heads = getattr(config, "n_heads", None)  # the demo GPT's config
        heads = (n_heads, n_heads) if isinstance(n_heads, int) else None
    if heads is None:
        return
    if tensor > 1 and (heads[0] % tensor or heads[1] % tensor):
        return  # the tensor plan refused these heads by name already (a plan the user wrote is checked per call)
    try:
        check_heads(heads[0] // tensor, heads[1] // tensor, settings.degree)
    except SequenceParallelError as error:
        if tensor == 1:
            raise
        raise SequenceParallelError(f"with tensor parallelism of degree {tensor} each rank holds {heads[0] // tensor} "
                                    f"of the {heads[0]} query heads ({heads[1] // tensor} of {heads[1]} key/value "
                                    f"heads), and Ulysses splits those: {error}") from None


def _wire_attention(model: torch.nn.Module, engine: EngineSequence, state: SequenceParallelState) -> None:
    own: list[torch.nn.Module] = [m for m in model.modules() if isinstance(m, DistributedAttention) and m.spg is None]
    if own:
        for module in own:
            register_engine_sequence(module, engine)
        state.attention_modules = own
        return
    if not hf.is_hf_model(model):
        raise SequenceParallelError(
            f"{type(model).__name__} has no attention zerodist can make sequence-parallel: build its attention with "
            "zerodist.sequence.DistributedAttention(local_attention, None, ...) (as zerodist.models.gpt does), or use "
            "a Hugging Face model whose attention goes through transformers' AttentionInterface")
    hf.register_attention()
    previous: Any = getattr(model, "config")._attn_implementation
    try:
        model.set_attn_implementation(hf.ATTENTION_NAME)  # type: ignore[operator]
    except BaseException:
        hf.unregister_attention()
        raise
    state.hf_previous = str(previous)  # from here on, remove_hooks() unregisters
    state.attention_modules = list(model.modules())  # the function finds its settings by the attention module
    for module in state.attention_modules:
        register_engine_sequence(module, engine)


def _call_arguments(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The forward's arguments by name, `**kwargs` spread out."""
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except TypeError:
        return dict(kwargs)
    named = dict(bound.arguments)
    for name, parameter in inspect.signature(module.forward).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and isinstance(named.get(name), dict):
            named.update(named.pop(name))
    return named


def _check_call(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    named = _call_arguments(module, args, kwargs)
    if named.get("position_ids") is None:
        raise SequenceParallelError(
            f"{type(module).__name__} was called without position_ids under sequence parallelism: each rank holds a "
            "slice of the sequence, so the model cannot number its tokens itself. Feed batches through the engine's "
            "data loader (or zerodist.sequence.data.shard_batch), which slices them and adds position_ids")
    if named.get("labels") is not None and named.get("shift_labels") is None:
        raise SequenceParallelError(
            "the model was given labels but no shift_labels under sequence parallelism: a slice cannot shift its own "
            "labels (its last token's label is on the next rank). Shift them before the split: "
            "zerodist.sequence.data.shard_batch adds shift_labels")
    mask = named.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
        raise SequenceParallelError("an attention_mask with padding cannot be split over the sequence: label the "
                                    "padding -100 instead (it then counts in no loss)")


def _agree_call(group: Group) -> Any:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        agree_call_shapes(tensors, group, f"the tensors {type(module).__name__}'s forward was called with, in order",
                          comm.device_for_rank())
    return hook


def _weighted_loss(group: Group) -> Any:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        named = _call_arguments(module, args, kwargs)
        labels = next((named[name] for name in LABEL_ARGUMENTS if isinstance(named.get(name), torch.Tensor)), None)
        if labels is None:
            return None  # no labels: no loss to weight (logits only)
        if isinstance(output, torch.Tensor) and output.dim() == 0:
            return token_weighted_mean(output, labels, group)
        loss = getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            output.loss = token_weighted_mean(loss, labels, group)
            return output
        return None
    return hook
