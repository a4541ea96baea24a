"""`parallelize(model, plan, topology)`: tensor parallelism for a model the user already wrote.

A plan maps module-name patterns (`fnmatch` globs over `named_modules()` names, e.g.
`"blocks.*.mlp.fc_in"`) to what to do with the matching modules, as a word or an entry object:

| word          | entry                      | applies to     | becomes                                          |
| ------------- | -------------------------- | -------------- | ------------------------------------------------ |
| `colwise`     | `Colwise()`                | `nn.Linear`    | `ColumnParallelLinear`, output split (last dim)  |
| `colwise_rep` | `Colwise(gather_output=True)` | `nn.Linear` | the same, output gathered (e.g. an LM head)      |
| `rowwise`     | `Rowwise()`                | `nn.Linear`    | `RowParallelLinear`, input split, output summed  |
| `vocab`       | `Vocab()`                  | `nn.Embedding` | `VocabParallelEmbedding`                         |
| `sequence`    | `Sequence()`               | any (norms)    | runs on sequence shards: its parameters' gradients are partial, summed over `tensor` too |
| `sequence_scatter` | `SequenceScatter()`   | any            | its output is split along the sequence (a positional embedding under sequence parallelism) |
| -             | `ScatterInput()`           | any (a first block) | under sequence parallelism its first input is split along the sequence before its forward |
| `replicate`   | `Replicate()`              | any            | unchanged, replicated (the default for unnamed modules) |
| `prepare_input` | `PrepareInput()`         | any (attention, MLP) | its column-parallel layers that read the same tensor share one copy to the tensor region (one input-gradient all-reduce; under sequence parallelism one all-gather) |
|               | `Replace(build)`           | any            | `build(module, region)`: a module the plan writes (e.g. head-parallel attention) |
|               | `TiedHead(embedding)`      | `nn.Linear`    | an LM head tied to `embedding` (made `vocab`): shares its slice, logits gathered |

Fused weights name their sub-parameters: `Colwise(fused=3)` (three equal parts: QKV) or
`Colwise(fused=(q, k, v))`. `sequence_parallel=True` puts every colwise/rowwise/vocab layer in
sequence-parallel mode (inputs/outputs split along dim -2 between them).

The layers keep the names of the modules they replace (`weight`, `bias`), so the model's
`state_dict()` keys do not change; `unsliced_state_dict(model)` gathers the model as it was.
`shared_inputs(model, plan)` adds `PrepareInput()` for every module holding two or more of the
plan's column-parallel layers (a Llama attention's q/k/v, its MLP's gate/up); the built-in Hugging
Face Llama plan and `plan_from_deepspeed` call it.
DeepSpeed's `"tensor_parallel": {"autotp_size": t, "partition_config": {"layer_specs": [...]}}`
becomes a plan through `plan_from_deepspeed(...)`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Mapping
from typing import Any, Union, cast

import torch
from torch import nn

from zerodist import comm
from zerodist.comm.domains import declare_placement, parameter_placements
from zerodist.comm.topology import Topology
from zerodist.tensor_parallel import operators as ops
from zerodist.tensor_parallel.layers import (
    SEQUENCE_PARTIAL,
    ColumnParallelLinear,
    RowParallelLinear,
    SliceSpec,
    TiedVocabParallelHead,
    VocabParallelEmbedding,
    unslice_tensor,
)
from zerodist.tensor_parallel.conv1d import ColumnParallelConv1D, RowParallelConv1D
from zerodist.tensor_parallel.operators import TensorRegion
from zerodist.tensor_parallel.shared_input import SharedInput, first_input_hook
from zerodist.utils import did_you_mean


class PlanError(ValueError):
    """A tensor-parallel plan that does not fit the model."""


@dataclasses.dataclass(frozen=True)
class Colwise:
    """`sequence_input=False`: under sequence parallelism the layer reads a whole sequence (after a
    `Sequence(gather_output=True)` module) and does not gather its input."""

    gather_output: bool = False
    fused: int | tuple[int, ...] = ()
    sequence_input: bool = True


@dataclasses.dataclass(frozen=True)
class Rowwise:
    input_is_parallel: bool = True


@dataclasses.dataclass(frozen=True)
class Vocab:
    """`sequence_output=False`: under sequence parallelism the embedding's output stays whole
    (all-reduced, not reduce-scattered), for a model that reads its length ([Note: Megatron SP on
    Hugging Face models] in plans.py); a later `ScatterInput` splits it."""

    sequence_output: bool = True


@dataclasses.dataclass(frozen=True)
class Sequence:
    """`gather_output`: the module's output is all-gathered along dim -2 (backward: this rank's
    slice of the gradient, which the layers after it made whole), for a model that reshapes the
    last norm's output by the sequence length ([Note: Megatron SP on Hugging Face models])."""

    gather_output: bool = False


@dataclasses.dataclass(frozen=True)
class SequenceScatter:
    dim: int = -2


@dataclasses.dataclass(frozen=True)
class ScatterInput:
    """Under sequence parallelism, the module's first input (positional, or `hidden_states`) is
    split along `dim` over the tensor ranks before its forward (backward: all-gathered)."""

    dim: int = -2


@dataclasses.dataclass(frozen=True)
class Replicate:
    pass


@dataclasses.dataclass(frozen=True)
class PrepareInput:
    """A module whose column-parallel layers share one copy of each input they read to the tensor
    region (torchtitan's `PrepareModuleInput`; see `shared_input.py`). `at_entry`: the module's
    first input is copied (under sequence parallelism: gathered) as the module is called, so its
    own code sees the whole sequence (a Hugging Face attention takes its shapes from its input)."""

    at_entry: bool = False


@dataclasses.dataclass(frozen=True)
class TiedHead:
    """An LM head (`nn.Linear` without bias) whose weight is tied to the embedding module named
    `embedding`, which the plan makes `vocab`: it becomes a `TiedVocabParallelHead` over the same
    vocab-parallel slice (the tie kept), logits gathered."""

    embedding: str
    sequence_input: bool = True  # False: its input is a whole sequence (see `Colwise`)


@dataclasses.dataclass(frozen=True)
class Replace:
    build: Callable[[nn.Module, TensorRegion, bool], nn.Module]  # (module, region, sequence_parallel)


PlanEntry = Union[Colwise, Rowwise, Vocab, Sequence, SequenceScatter, ScatterInput, Replicate, Replace, TiedHead,
                  PrepareInput]
WORDS: dict[str, PlanEntry] = {
    "colwise": Colwise(), "colwise_rep": Colwise(gather_output=True),
    "colwise_gather_output": Colwise(gather_output=True), "rowwise": Rowwise(), "vocab": Vocab(),
    "sequence": Sequence(), "sequence_scatter": SequenceScatter(), "replicate": Replicate(),
    "prepare_input": PrepareInput(),
}


def _entry(pattern: str, value: str | PlanEntry) -> PlanEntry:
    if isinstance(value, str):
        if value not in WORDS:
            raise PlanError(f"plan entry {pattern!r}: unknown word {value!r}{did_you_mean(value, WORDS)}; "
                            f"the words are {', '.join(WORDS)}")
        return WORDS[value]
    if not isinstance(value, PlanEntry.__args__):  # type: ignore[attr-defined]
        raise PlanError(f"plan entry {pattern!r}: {value!r} is neither a plan word nor a plan entry object")
    return value


def _match(model: nn.Module, plan: Mapping[str, str | PlanEntry]) -> list[tuple[str, nn.Module, PlanEntry]]:
    """(name, module, entry) for every module a pattern names, each module named once."""
    modules = dict(model.named_modules())
    chosen: dict[str, tuple[str, PlanEntry]] = {}
    for pattern, value in plan.items():
        entry = _entry(pattern, value)
        names = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not names:
            sample = ", ".join(list(n for n in modules if n)[:8])
            raise PlanError(f"plan pattern {pattern!r} matches no module of {type(model).__name__} "
                            f"(its modules include: {sample}){did_you_mean(pattern, [n for n in modules if n])}")
        for name in names:
            if name in chosen:
                raise PlanError(f"module {name!r} is matched by both {chosen[name][0]!r} and {pattern!r}")
            chosen[name] = (pattern, entry)
    replaced = [n for n, (_, e) in chosen.items() if isinstance(e, Replace)]
    inside = [n for n in chosen if any(n.startswith(r + ".") for r in replaced)]
    if inside:
        raise PlanError(f"modules {inside} lie inside a module the plan replaces; the replacement builds them")
    return [(name, modules[name], entry) for name, (_, entry) in chosen.items()]


def _convert(name: str, module: nn.Module, entry: PlanEntry, region: TensorRegion, sequence_parallel: bool):
    """The module that replaces `module`, or None when it stays (hooks and declarations only)."""
    wants = {Colwise: nn.Linear, Rowwise: nn.Linear, Vocab: nn.Embedding}.get(type(entry))
    if wants is not None and not isinstance(module, wants):
        raise PlanError(f"plan entry for {name!r} is {type(entry).__name__}, which applies to {wants.__name__}, "
                        f"but {name!r} is a {type(module).__name__}")
    # `wants` checked the module's class above.
    if isinstance(entry, Colwise):
        linear = cast(nn.Linear, module)
        fused = entry.fused
        if isinstance(fused, int):
            fused = (linear.out_features // fused,) * fused
        return ColumnParallelLinear.from_linear(linear, region, gather_output=entry.gather_output,
                                                sequence_parallel=sequence_parallel and entry.sequence_input,
                                                fused=fused)
    if isinstance(entry, Rowwise):
        return RowParallelLinear.from_linear(cast(nn.Linear, module), region, input_is_parallel=entry.input_is_parallel,
                                             sequence_parallel=sequence_parallel)
    if isinstance(entry, Vocab):
        return VocabParallelEmbedding.from_embedding(cast(nn.Embedding, module), region,
                                                     sequence_parallel=sequence_parallel and entry.sequence_output)
    if isinstance(entry, Replace):
        return entry.build(module, region, sequence_parallel)
    if isinstance(entry, Sequence):
        declare_placement(module, SEQUENCE_PARTIAL)
        if entry.gather_output and sequence_parallel:
            module.register_forward_hook(lambda _m, _a, out: ops.gather_sequence_keep_slice(out, region))
    elif isinstance(entry, SequenceScatter):
        dim = entry.dim
        module.register_forward_hook(lambda _m, _a, out: ops.scatter_to_sequence_region(out, region, dim))
    elif isinstance(entry, ScatterInput) and sequence_parallel:
        module.register_forward_pre_hook(first_input_hook(lambda x: ops.scatter_to_sequence_region(x, region, entry.dim)),
                                         with_kwargs=True)
    return None


def _keep_frozen(name: str, old: nn.Module, new: nn.Module) -> None:
    """A converted layer's parameters are new `nn.Parameter`s (each rank's slices), which need a
    gradient by default: those cut from a frozen parameter stay frozen, so LoRA's frozen base, or any
    weight frozen before `initialize`, is not trained under tensor parallelism. Matched by name; a
    replacement (`Replace`) whose names differ from the module it replaces is frozen whole when all
    of that module was (its own new parameters too), and refused when only part of it was."""
    frozen = {key for key, param in old.named_parameters() if not param.requires_grad}
    if not frozen:
        return
    params = dict(new.named_parameters())
    everything = len(frozen) == len(list(old.parameters()))
    unmatched = sorted(frozen - set(params))
    if unmatched and not everything:
        raise PlanError(f"plan entry for {name!r}: the module that replaces it has no parameter named "
                        f"{', '.join(unmatched)}, which is frozen (requires_grad=False), so there is no knowing "
                        "which of its parameters to freeze; freeze all of the module or none, or keep the names")
    for key, param in params.items():
        if key in frozen or everything:
            param.requires_grad_(False)


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent.register_module(child, new)


def _tied_heads(matched: list[tuple[str, nn.Module, PlanEntry]]) -> set[int]:
    """The ids of the parameters `TiedHead` entries keep tied, after checking each entry: the
    head's weight is its embedding's, and the plan makes that embedding `vocab`."""
    vocab = {name: module for name, module, entry in matched if isinstance(entry, Vocab)}
    kept: set[int] = set()
    for name, module, entry in matched:
        if not isinstance(entry, TiedHead):
            continue
        if entry.embedding not in vocab:
            raise PlanError(f"plan entry for {name!r} ties it to {entry.embedding!r}, which the plan must make "
                            f"'vocab' (it does not)")
        if not isinstance(module, nn.Linear) or module.bias is not None:
            raise PlanError(f"plan entry for {name!r} is TiedHead, which applies to an nn.Linear without bias, "
                            f"but {name!r} is a {type(module).__name__}")
        if module.weight is not vocab[entry.embedding].weight:
            raise PlanError(f"{name}.weight is not tied to {entry.embedding}.weight; use 'colwise_rep' for a head "
                            "with its own weight")
        kept.add(id(module.weight))
    return kept


def _check_ties(model: nn.Module, matched: list[tuple[str, nn.Module, PlanEntry]]) -> None:
    kept = _tied_heads(matched)
    seen: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen and id(param) not in kept and any(
                name.startswith(n + ".") or seen[id(param)].startswith(n + ".")
                for n, _, e in matched if not isinstance(e, (Replicate, Sequence, PrepareInput, ScatterInput))):
            raise PlanError(f"{name!r} and {seen[id(param)]!r} are one tied parameter; tensor parallelism "
                            "slices each layer on its own, so untie them (e.g. tie_embeddings=False), or, "
                            "for an LM head tied to a vocab-parallel embedding, use TiedHead(embedding)")
        seen.setdefault(id(param), name)


def parallelize(model: nn.Module, plan: Mapping[str, str | PlanEntry], topology: Topology, *,
                sequence_parallel: bool = False) -> nn.Module:
    """Apply `plan` to `model` in place over `topology`'s tensor axis; returns `model`.

    Every rank must call it with the same model (the same full weights: build it from the same
    seed): each rank keeps its slice. With tensor degree 1 the layers are swapped all the same
    and no collective ever runs."""
    region = TensorRegion.of(topology)
    matched = _match(model, plan)
    _check_ties(model, matched)
    with torch.no_grad():
        # Tied heads last: each takes its embedding's converted (sliced) parameter.
        for name, module, entry in sorted(matched, key=lambda item: isinstance(item[2], TiedHead)):
            if isinstance(entry, TiedHead):
                embedding = cast(VocabParallelEmbedding, model.get_submodule(entry.embedding))  # converted by now
                new = TiedVocabParallelHead(embedding, sequence_parallel=sequence_parallel and entry.sequence_input)
            else:
                new = _convert(name, module, entry, region, sequence_parallel)
            if new is not None:
                _keep_frozen(name, module, new)
                _set_submodule(model, name, new)
    _prepare_inputs(model, {name: entry for name, _, entry in matched if isinstance(entry, PrepareInput)}, region,
                    sequence_parallel)
    return model


def _prepare_inputs(model: nn.Module, entries: dict[str, PrepareInput], region: TensorRegion,
                    sequence_parallel: bool) -> None:
    """A `SharedInput` scope on each named module, given to the column-parallel layers inside it
    (outer modules first, so the innermost scope wins)."""
    for name in sorted(entries, key=lambda n: n.count(".")):
        module = model.get_submodule(name)
        scope = SharedInput(region, sequence_parallel)
        scope.attach(module, at_entry=entries[name].at_entry)
        for layer in module.modules():
            if isinstance(layer, (ColumnParallelLinear, ColumnParallelConv1D)) and not isinstance(
                    layer, TiedVocabParallelHead):
                layer.shared_input = scope


def shared_inputs(model: nn.Module, plan: Mapping[str, str | PlanEntry]) -> dict[str, str | PlanEntry]:
    """`plan` plus `PrepareInput()` for every module that directly holds two or more of the plan's
    column-parallel layers and that the plan names otherwise not (one input-gradient all-reduce for
    a Llama attention's q, k and v instead of three). Sharing is by tensor identity at run time, so
    layers that read different tensors still reduce on their own."""
    result = dict(plan)
    columns: dict[str, int] = {}
    named = set()
    for name, _, entry in _match(model, plan):
        named.add(name)
        if isinstance(entry, Colwise) and "." in name:
            parent = name.rpartition(".")[0]
            columns[parent] = columns.get(parent, 0) + 1
    for parent, count in columns.items():
        if count >= 2 and parent not in named:
            result[parent] = PrepareInput()
    return result


_SLICED_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ColumnParallelConv1D,
                  RowParallelConv1D)


def _slice_specs(module: nn.Module) -> dict[str, SliceSpec]:
    """A tensor-parallel layer's sliced parameters (local names) and how each was cut."""
    if isinstance(module, (ColumnParallelConv1D, RowParallelConv1D)):
        return module.slice_specs()
    layer = cast(Union[ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding], module)
    specs = {"weight": layer.weight_spec}
    if isinstance(module, ColumnParallelLinear) and module.bias is not None:
        specs["bias"] = module.weight_spec
    return specs


def sliced_parameters(model: nn.Module) -> dict[str, tuple[SliceSpec, TensorRegion]]:
    """`state_dict()` key of every tensor-parallel slice -> (its SliceSpec, its region). A tied
    head's weight appears under its own key as well as the embedding's."""
    found = {}
    for prefix, module in model.named_modules():
        if isinstance(module, _SLICED_LAYERS):
            dot = prefix + "." if prefix else ""
            found.update({dot + local: (spec, module.region) for local, spec in _slice_specs(module).items()})
    return found


def unsliced_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The `state_dict()` of the model before `parallelize`: every slice gathered over the
    tensor axis (a collective: call on every rank), same keys, logical shapes."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for key, (spec, region) in sliced_parameters(model).items():
        state[key] = unslice_tensor(model.get_parameter(key), spec, region)
    return state


def unsliced_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient on the logical (unsliced) shape, keyed by parameter name."""
    grads = {}
    specs = sliced_parameters(model)
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        spec = specs.get(name)
        grads[name] = param.grad.detach().clone() if spec is None else unslice_tensor(param.grad, *spec)
    return grads


def reduce_partial_gradients(model: nn.Module, topology: Topology) -> None:
    """Sum over the tensor axis the gradients that are partial there (parameters declared with
    `tensor` among their reduce axes: norms and row biases under sequence parallelism). The ZeRO
    engine does this itself; a plain training loop calls it after `backward()`."""
    placements = parameter_placements(model)
    group = topology.group("tensor")
    for param in model.parameters():
        if param.grad is not None and "tensor" in placements[id(param)].domain.reduce_axes:
            comm.all_reduce(param.grad, group=group)


# ------------------------------------------------------------------ DeepSpeed's config form
def plan_from_deepspeed(model: nn.Module, partition_config: Mapping[str, Any]) -> dict[str, PlanEntry]:
    """A plan from DeepSpeed's `partition_config.layer_specs`: each spec's `patterns` are regexes
    over *parameter* names (`".*\\.q_proj\\.weight$"`), `partition_type` is "column", "row" or
    "skip"; `shape: [k, -1]` names k equal fused sub-parameters; `gather_output` gathers a column
    layer's output."""
    specs = partition_config.get("layer_specs") or []
    if not specs:
        raise PlanError("tensor_parallel.partition_config.layer_specs is empty; give at least one "
                        '{"patterns": [...], "partition_type": "column" | "row"}')
    plan: dict[str, PlanEntry] = {}
    for index, spec in enumerate(specs):
        kind = spec.get("partition_type")
        if kind not in ("column", "row", "skip"):
            raise PlanError(f"layer_specs[{index}].partition_type is {kind!r}; use 'column', 'row' or 'skip'")
        entry = _deepspeed_entry(index, kind, spec)
        regexes = [re.compile(p) for p in spec.get("patterns", [])]
        names = [name.rpartition(".")[0] for name, _ in model.named_parameters()
                 if any(r.search(name) for r in regexes)]
        if not names:
            raise PlanError(f"layer_specs[{index}] patterns {spec.get('patterns')} match no parameter name")
        for name in dict.fromkeys(names):
            plan.setdefault(name, entry)
    return cast(dict[str, PlanEntry], shared_inputs(model, plan))


def _deepspeed_entry(index: int, kind: str, spec: Mapping[str, Any]) -> PlanEntry:
    if kind == "skip":
        return Replicate()
    if kind == "row":
        return Rowwise()
    shape = spec.get("shape")
    fused: int | tuple[int, ...] = ()
    if shape is not None:
        if len(shape) != 2 or shape[1] != -1 or not isinstance(shape[0], int) or shape[0] < 1:
            raise PlanError(f"layer_specs[{index}].shape {shape!r}: only [k, -1] (k equal fused parts) is supported")
        fused = shape[0]
    if spec.get("partition_dim", 0) != 0:
        raise PlanError(f"layer_specs[{index}].partition_dim must be 0 for a column layer")
    return Colwise(gather_output=bool(spec.get("gather_output", False)), fused=fused)
