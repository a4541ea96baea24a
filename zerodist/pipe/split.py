"""Split a model the user already wrote into pipeline stages, keeping its parameter names.

    model = LlamaForCausalLM(config)                       # or GPT2LMHeadModel, zerodist's GPT, ...
    stages = zerodist.pipe.split_model(model, num_stages=2)                 # cuts balanced
    stages = zerodist.pipe.split_model(model, split_points=["model.layers.2"])  # a stage starts there
    engine, *_ = zerodist.initialize(model=stages, config=...)
    loss = engine.train_batch(iter([(input_ids, labels), ...]))

[Note: split keeps the names] torchtitan's way: the result is a `PipelineModule` (so the engine,
executor and schedules are the same) whose layers are `SplitLayer`s: small callables, one for the
embedding, one per block, the final norm and the head, each running the user's own submodules
through the plan's glue (`split_plans.py`). A layer is a callable, not a module, so nothing is
registered under its index; instead this rank's stage module registers the user's submodules of
its own stages under their dotted names in the model, in plain containers of its own
(`model.layers.3`, `lm_head`). So a stage's `state_dict()` keys are the model's own keys
(`model.layers.3.self_attn.q_proj.weight`), the union over stages is the unsplit model's keys,
and a checkpoint keyed by them loads with and without a pipeline. The user's model is read, never
written: no attribute is set on it and no module is deleted from it, so every rank keeps the
whole model in memory (build it on every rank as for data parallelism); the stage module only
references the parts its stages run.

Only hidden states travel between stages: each stage recomputes what else its blocks need
(position ids, rotary embeddings, the causal mask) from their shape. The glue reads modules by
the model's names through the stage module (`_StageView`), so what runs is what the stage holds.

A parameter that parts on different stages share (GPT-2's `transformer.wte.weight`, which
`lm_head.weight` is; the demo GPT with `tie_embeddings`) is a tied layer across those stages, kept
equal by `pipe/tied.py` as a `TiedLayerSpec` would be ([Note: tied gradients]).

[Note: tied parameters keep their first name] In the unsplit model such a parameter is trained
under its first name (`transformer.wte.weight`) and `lm_head.weight` is an alias of it. So every
stage that holds it also registers the module that owns it under that name (the last stage holds
`transformer.wte` beside `lm_head`: the same one tensor, no more memory), and each stage registers
its parts in the model's order: the parameter is trained under the same name on every stage and
in the unsplit model, `lm_head.weight` stays an alias, and one checkpoint loads with and without
the pipeline. The stages' copies are equal, so the checkpoint keeps one of them
(`build_manifest` in zerodist/checkpoint/save.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zerodist import compat
from zerodist.pipe.module import PartitionError, PipelineModule, _pipe_degree, partition_balanced
from zerodist.pipe.split_plans import SplitPlan, find_split_plan, token_cross_entropy

__all__ = ["SplitError", "SplitLayer", "SplitPipelineModule", "split_model"]


class SplitError(PartitionError):
    """The model cannot be split as asked (a name the plan or a split point gives is not in the
    model, a cut leaves a stage empty, more stages than blocks, a plan that leaves state out)."""


class _StageView:
    """What the plan's glue calls `model`: a module name resolves on the stage module (the part it
    holds), anything else on the user's model (its config). Not a module, so never registered."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._stage: nn.Module | None = None
        self._numbering: Callable[[int], torch.Tensor] | None = None  # [Note: sequence x pipe]

    def token_positions(self, length: int, device: torch.device) -> torch.Tensor:
        """The places in the whole sequence of a stage's `length` tokens (`split_plans.token_positions`)."""
        if self._numbering is None:
            return torch.arange(length, device=device)
        return self._numbering(length).to(device)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        child = compat.registered_child(self._stage, name) if self._stage is not None else None
        return child if child is not None else getattr(self._model, name)

    def get_submodule(self, target: str) -> nn.Module:
        """A dotted name of the stage module first: a module a technique swapped there (tensor
        parallelism's slices) is the one that runs, not the user's original under the same name."""
        if self._stage is not None:
            try:
                return self._stage.get_submodule(target)
            except AttributeError:
                pass
        return self._model.get_submodule(target)


class _Container(nn.Module):
    """A stage's own node on the path to a part (`model` in `model.layers.3`); no forward."""


class SplitLayer:
    """One pipeline layer of a split model: `name` (what split points name), the model's modules it
    runs (`modules`, registered on its stage) and `run(view, x)`."""

    def __init__(self, name: str, modules: Sequence[str], run: Callable[[_StageView, Any], Any], view: _StageView):
        self.name, self.modules, self._run, self._view = name, tuple(modules), run, view

    def __call__(self, inputs: Any) -> Any:
        return self._run(self._view, inputs)

    def __repr__(self) -> str:
        return f"SplitLayer({self.name!r})"


def _make_layers(plan: SplitPlan, num_blocks: int, view: _StageView) -> list[SplitLayer]:
    """Embedding, each block, the final norm (if any), the head; each resolves its modules by name
    on the stage when it runs."""
    layers = [SplitLayer(plan.embed[0], plan.embed, lambda v, x: plan.run_embed(v, x), view)]  # type: ignore[arg-type]
    for index in range(num_blocks):
        name = f"{plan.blocks}.{index}"
        layers.append(SplitLayer(name, (name,), _block_runner(plan, name), view))
    for name in ([plan.norm] if plan.norm else []) + [plan.head]:
        layers.append(SplitLayer(name, (name,), _module_runner(plan, name), view))
    return layers


def _block_runner(plan: SplitPlan, name: str) -> Callable[[_StageView, Any], Any]:
    def run(view: _StageView, hidden: Any) -> Any:
        assert view._stage is not None
        return plan.run_block(view, view._stage.get_submodule(name), hidden)  # type: ignore[arg-type]
    return run


def _module_runner(plan: SplitPlan, name: str) -> Callable[[_StageView, Any], Any]:
    def run(view: _StageView, hidden: Any) -> Any:
        assert view._stage is not None
        return plan.run_layer(view._stage.get_submodule(name), hidden)
    return run


# ---------------------------------------------------------------------------------------- checks (no processes)
def _resolve(model: nn.Module, plan: SplitPlan, name: str, role: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        top = ", ".join(n for n, _ in model.named_children())
        raise SplitError(f"{plan.name} names {role} {name!r}, which {type(model).__name__} does not have (its "
                         f"top-level modules: {top}); give split_model a plan with the model's own names") from None


def check_plan(model: nn.Module, plan: SplitPlan) -> int:
    """Every module the plan names exists, no part lies inside another, the parts hold every
    state-dict entry of the model and the shared modules none: the number of blocks."""
    blocks = _resolve(model, plan, plan.blocks, "the blocks")
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) == 0:
        raise SplitError(f"{plan.name}: {plan.blocks!r} is a {type(blocks).__name__} of {len(list(blocks.children()))} "
                         "modules; the blocks are a non-empty nn.ModuleList (or nn.Sequential)")
    parts = [*plan.embed, plan.blocks, *([plan.norm] if plan.norm else []), plan.head, *plan.shared]
    for name in parts:
        _resolve(model, plan, name, "the module")
    twice = sorted({name for name in parts if parts.count(name) > 1})
    if twice:
        raise SplitError(f"{plan.name} names {twice} more than once; each module belongs to one part")
    for outer in parts:
        for inner in parts:
            if inner != outer and inner.startswith(outer + "."):
                raise SplitError(f"{plan.name}: {inner!r} lies inside {outer!r}; each module belongs to one part")
    for name in plan.shared:
        if any(True for _ in model.get_submodule(name).parameters()):
            raise SplitError(f"{plan.name}: shared module {name!r} has parameters; every stage holds a shared module, so "
                             "it must be parameterless (put a module with parameters in embed, the blocks, norm or head)")
    covered = set()
    for name in parts:
        covered |= set(model.get_submodule(name).state_dict(prefix=name + ".", keep_vars=True))
    left_out = sorted(set(model.state_dict(keep_vars=True)) - covered)
    if left_out:
        raise SplitError(f"{plan.name} leaves out {len(left_out)} state-dict entries of {type(model).__name__} (e.g. "
                         f"{', '.join(left_out[:4])}): no stage would hold them; name their modules in the plan")
    return len(blocks)


def _cuts_from_points(layers: list[SplitLayer], split_points: Sequence[str], total: int) -> list[int]:
    names = [layer.name for layer in layers]
    points = [split_points] if isinstance(split_points, str) else list(split_points)
    if len(points) != total - 1:
        raise SplitError(f"{len(points)} split point(s) {points} make {len(points) + 1} stages, but the pipeline has "
                         f"{total}; give {total - 1} (a stage starts at each)")
    cuts = []
    for point in points:
        if point not in names:
            raise SplitError(f"split point {point!r} is not a layer of this model; a stage can start at one of "
                             f"{names[1]} .. {names[-1]} ({', '.join(names[1:4])}, ...)")
        cuts.append(names.index(point))
    bounds = [0, *cuts, len(layers)]
    for stage in range(total):
        if bounds[stage + 1] <= bounds[stage]:
            where = "the first layer" if bounds[stage + 1] == 0 else repr(names[bounds[stage + 1]])
            raise SplitError(f"split points {points} leave stage {stage} empty (the cut at {where}); give them in "
                             "the model's order, each after the previous, none at the first layer")
    return bounds


def _balanced_cuts(layers: list[SplitLayer], plan: SplitPlan, total: int) -> list[int]:
    # torchtitan counts the embedding and the head as a layer each and the norm as nothing
    weights = [0.0 if layer.name == plan.norm else 1.0 for layer in layers]
    return partition_balanced(weights, total)


def _find_ties(model: nn.Module, stage_parts: dict[int, list[str]]) -> dict[str, tuple[torch.nn.Parameter, list[int],
                                                                                          str]]:
    """Parameters that parts on several stages hold (an embedding a head reuses), by their first
    name in the model: (the parameter, those stages, the module that owns it under that name)."""
    stages_of: dict[int, list[int]] = collections.defaultdict(list)
    for stage, names in stage_parts.items():
        for name in names:
            for param in model.get_submodule(name).parameters():
                if stage not in stages_of[id(param)]:
                    stages_of[id(param)].append(stage)
    return {key: (param, stages_of[id(param)], key.rpartition(".")[0])
            for key, param in model.named_parameters() if len(stages_of[id(param)]) > 1}


# ---------------------------------------------------------------------------------------- the stage module
class SplitPipelineModule(PipelineModule):
    """A `PipelineModule` of a user's model cut into stages, keyed by the model's own names
    ([Note: split keeps the names]). Made by `split_model`."""

    def __init__(self, model: nn.Module, plan: SplitPlan, layers: list[SplitLayer], view: _StageView,
                 bounds: list[int], *, num_stages: int, loss_fn: Callable[..., torch.Tensor] | None,
                 stages_per_rank: int, activation_checkpoint_interval: int):
        self._split_bounds = bounds  # read by _partition, during PipelineModule.__init__
        super().__init__(layers, num_stages=num_stages, loss_fn=loss_fn, partition_method="split points",
                         stages_per_rank=stages_per_rank, activation_checkpoint_interval=activation_checkpoint_interval)
        self.plan = plan
        self.layer_names = [layer.name for layer in layers]
        self.layer_classes = [f"SplitLayer({name})" for name in self.layer_names]  # what the ranks agree on
        self._stage_parts = {stage: [name for index in self.stage_layers(stage) for name in layers[index].modules]
                             for stage in range(self.total_stages)}
        ties = _find_ties(model, self._stage_parts)
        for _, stages, anchor in ties.values():  # [Note: tied parameters keep their first name]
            for stage in stages:
                if not any(anchor == name or anchor.startswith(name + ".") for name in self._stage_parts[stage]):
                    self._stage_parts[stage].append(anchor)
        order = {name: index for index, (name, _) in enumerate(model.named_modules())}
        local = {name for stage in self.local_stages for name in self._stage_parts[stage]} | set(plan.shared)
        for name in sorted(local, key=order.__getitem__):  # in the model's order, as its state_dict() walks
            self._register(name, model.get_submodule(name))
        view._stage = self
        self._view = view  # not a module: the user's model stays unregistered (`source_model`)
        self._plain_loss_fn = loss_fn  # what `shard_sequence` weighs and gives back
        self._keep_ties(ties)

    def _partition(self, layers: Sequence[Any], partition_method: str) -> list[int]:
        return list(self._split_bounds)

    def _register(self, dotted: str, module: nn.Module) -> None:
        """`module` under its dotted name, in containers of this module's own (never the user's)."""
        *path, leaf = dotted.split(".")
        parent: nn.Module = self
        for part in path:
            child = compat.registered_child(parent, part)
            if child is None:
                if parent is self and hasattr(self, part):
                    raise SplitError(f"the model's top-level module {part!r} has the name of a PipelineModule attribute")
                child = _Container()
                parent.add_module(part, child)
            elif not isinstance(child, _Container):  # never add to a module of the user's
                raise SplitError(f"{dotted} lies inside {type(child).__name__} {part!r}, which this stage holds "
                                 "whole; each module belongs to one part")
            parent = child
        if parent is self and (leaf.isdigit() or hasattr(self, leaf)):
            raise SplitError(f"the model's top-level module {leaf!r} cannot be registered on a PipelineModule (a layer "
                             "index or one of its attributes has that name)")
        parent.add_module(leaf, module)

    def source_model(self) -> nn.Module:
        """The model this stage module was cut from (whole on every rank: its config, its class), for
        what picks a plan by the model, as tensor parallelism does; the names match this module's."""
        return self._view._model

    def shard_sequence(self, positions_of: Callable[[int], torch.Tensor] | None,
                       weigh_loss: Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]] | None) -> None:
        """[Note: sequence x pipe] Under sequence parallelism every stage of this rank holds a slice
        of each sequence: the glue numbers its tokens with `positions_of(local_length)` (their places
        in the whole sequence, not 0..n-1), and the loss is `weigh_loss(loss_fn)` (the token-weighted
        mean over the sequence group). `shard_sequence(None, None)` gives back the plain ones.
        zerodist/sequence/apply.py calls it; the messages between stages are then each rank's slice."""
        self._view._numbering = positions_of
        plain = self._plain_loss_fn
        self.loss_fn = plain if weigh_loss is None or plain is None else weigh_loss(plain)

    def stage_modules(self, stage: int) -> list[nn.Module]:
        """The modules of `stage`'s parts, as registered now (after any swap by name)."""
        return [self.get_submodule(name) for name in self._stage_parts[stage]]

    # ------------------------------------------------------------------ tied parameters
    def _keep_ties(self, ties: dict[str, tuple[torch.nn.Parameter, list[int], str]]) -> None:
        """Tied keys for pipe/tied.py: the stages holding each, and on this rank the module that owns
        it under its first name in the model (`anchor`), which must hold nothing else."""
        self._tied_params: dict[str, torch.nn.Parameter] = {}
        self._tied_anchors: dict[str, str] = {}
        for key, (param, stages, anchor) in ties.items():
            self.tied_keys[key] = stages
            self._tied_attrs[key] = [key.rpartition(".")[2]]
            if not any(stage in stages for stage in self.local_stages):
                continue
            owner = self.get_submodule(anchor)
            if [id(p) for p in owner.parameters()] != [id(param)]:
                raise SplitError(f"{key} is shared by stages {stages}, and its module {anchor} "
                                 f"({type(owner).__name__}) has other parameters too; a tied parameter's module must "
                                 "hold only it (as an embedding or a bias-free head does)")
            self._tied_modules[key] = owner
            self._tied_params[key] = param
            self._tied_anchors[key] = anchor

    def tied_parameters(self) -> dict[str, list[torch.nn.Parameter]]:
        """The tied parameters this rank holds, by key: exactly the shared one of each, as its module
        registered under the model's name holds it now ([Note: tied slices] in zerodist/pipe/apply.py)."""
        result = {}
        for key in self._tied_params:
            param = getattr(self.tied_module(key), key.rpartition(".")[2], None)
            if isinstance(param, torch.nn.Parameter) and param.requires_grad:
                result[key] = [param]
        return result

    def tied_module(self, key: str) -> nn.Module:
        """The module that owns tied `key` under its first name, as registered now (after any swap)."""
        return self.get_submodule(self._tied_anchors[key])

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, plan={self.plan.name}, "
                f"stage starts={[self.layer_names[self.parts[s]] for s in range(self.total_stages)]}")


def split_model(model: nn.Module, num_stages: int | None = None, split_points: Sequence[str] | None = None, *,
                plan: SplitPlan | None = None, loss_fn: Callable[..., torch.Tensor] | None = token_cross_entropy,
                topology: Any = None, stages_per_rank: int = 1,
                activation_checkpoint_interval: int = 0) -> SplitPipelineModule:
    """Cut `model` into `num_stages` pipe ranks' stages (times `stages_per_rank`), at the layers
    `split_points` names (a stage starts at each: `"model.layers.2"`), else balanced: this rank's
    `SplitPipelineModule` for `zerodist.initialize(model=...)`. `plan`: the model family's
    (`find_split_plan`) unless given. `loss_fn(logits, labels)` (default: next-token cross-entropy,
    labels already shifted). Every check runs before any process-group work, alike on every rank."""
    if not isinstance(model, nn.Module) or isinstance(model, PipelineModule):
        raise TypeError(f"split_model takes the user's nn.Module (not a PipelineModule), got {type(model).__name__}")
    plan = plan or find_split_plan(model)
    num_blocks = check_plan(model, plan)
    if not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"split_model(stages_per_rank=...) takes a positive int, got {stages_per_rank!r}")
    if num_stages is None and topology is None and split_points is not None:  # the points say how many
        count = 1 + (1 if isinstance(split_points, str) else len(split_points))
        if count % stages_per_rank:
            raise SplitError(f"{count} stages (from the split points) do not fill {stages_per_rank} stages per rank")
        num_stages = count // stages_per_rank
    degree = _pipe_degree(num_stages, topology)
    total = degree * stages_per_rank
    if total > num_blocks:
        raise SplitError(f"{total} pipeline stages for {num_blocks} blocks: more stages than blocks; use at most "
                         f"{num_blocks} stages")
    view = _StageView(model)
    layers = _make_layers(plan, num_blocks, view)
    bounds = (_balanced_cuts(layers, plan, total) if split_points is None
              else _cuts_from_points(layers, split_points, total))
    if loss_fn is token_cross_entropy and plan.loss_for is not None:  # the default: the model's own loss
        loss_fn = plan.loss_for(model)
    return SplitPipelineModule(model, plan, layers, view, bounds, num_stages=degree, loss_fn=loss_fn,
                               stages_per_rank=stages_per_rank,
                               activation_checkpoint_interval=activation_checkpoint_interval)
