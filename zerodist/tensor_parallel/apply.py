"""The engine's "apply tensor parallel" step: pick the model's plan, parallelize, add Domino.

The plan, in order of precedence: the config's `tensor_parallel.partition_config.layer_specs`
(DeepSpeed's form); the built-in plan of zerodist's demo GPT; the built-in plan of Hugging Face
GPT-2 (`config.model_type == "gpt2"`); a Hugging Face model's own
`config.base_model_tp_plan`. A model the user already parallelized (it holds tensor-parallel
layers) is left as it is, after checking its degree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from typing import Any

import torch
from torch import nn

from zerodist.comm.topology import Topology
from zerodist.compat import pytree_registration_available
from zerodist.tensor_parallel.conv1d import ColumnParallelConv1D, RowParallelConv1D
from zerodist.tensor_parallel.domino import DominoConfig, apply_domino, find_blocks
from zerodist.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from zerodist.tensor_parallel.layers import slice_tensor, unslice_tensor
from zerodist.tensor_parallel.operators import TensorRegion
from zerodist.tensor_parallel.plan import PlanError, _check_ties, _match, parallelize, plan_from_deepspeed, sliced_parameters
from zerodist.tensor_parallel.plans import (gpt_block_branches, gpt_domino, gpt_plan, hf_gpt2_plan, hf_llama_plan,
                                            moe_gpt_plan)
from zerodist.tensor_parallel.random import RNGTracker, attach_rng_tracker, tensor_parallel_rng
from zerodist.tensor_parallel.shared_input import detach_shared_inputs
from zerodist.utils import get_logger, log_rank0

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class TensorParallelSettings:
    """What the step needs from the config (a slice of it)."""

    degree: int = 1
    partition_config: dict[str, Any] | None = None
    sequence_parallel: bool = False
    domino: DominoConfig | None = None
    sharded_parameters: bool = False  # ZeRO stage 3: blocks' parameters are released after their forward


# [Note: demo GPT plan] The imports against the layer table (tests/suite/test_architecture.py lists
# them, the demo GPT's and the demo MoE GPT's): `zerodist.models` sits above tensor_parallel (its MoE
# GPT is built from `zerodist.moe`), yet the engine's tensor-parallel step picks the demo GPT's built-in plan (and Domino's blocks) by the
# model's class: its config names no model type (a Hugging Face model's `config.model_type` does,
# and is recognised without an import). The import runs only inside this check, so importing
# tensor_parallel never imports the models, and the rule is bent for the project's own demo model.
def _is_demo_gpt(model: nn.Module) -> bool:
    from zerodist.models.gpt import GPT  # [Note: demo GPT plan]

    return isinstance(model, GPT)


def _is_demo_moe_gpt(model: nn.Module) -> bool:
    from zerodist.models.moe_gpt import MoEGPT  # [Note: demo GPT plan]

    return isinstance(model, MoEGPT)  # a subclass too, as _is_demo_gpt


# [Note: Domino inter at ZeRO-3] Under inter-layer overlap a chunk parks at its block's last
# row-parallel reduction and finishes the block (the reduced sum, then whatever the block computes
# after it: a post-norm, as BERT's norm(x + fc_out(...)) or Gemma's post_feedforward_layernorm; an
# MoE block's experts after its attention's reduction) while the next block runs. A block run in
# turns returns a `ChunkedStream`, an unfinished output ([Note: unfinished outputs] in
# zerodist/utils/unfinished.py): ZeRO-3 frees the block's parameters, and arms its backward gather
# on its outputs, only once the last chunk has left the block, so whatever the block reads after
# that reduction is gathered, on any model (at most one block more gathered per rank: the one the
# chunks are finishing, beside the one they start; docs/tensor_parallel.md). The demo GPT's blocks
# (residual branches) read nothing after the reduction but a copy of the bias ([Note: Domino at
# ZeRO-3] in plans.py / domino.py).


TENSOR_PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ColumnParallelConv1D,
                          RowParallelConv1D)


def _existing_degree(model: nn.Module) -> int | None:
    sizes = {m.region.size for m in model.modules() if isinstance(m, TENSOR_PARALLEL_LAYERS)}
    if len(sizes) > 1:
        raise PlanError(f"the model holds tensor-parallel layers of several degrees {sorted(sizes)}")
    return sizes.pop() if sizes else None


def choose_plan(model: nn.Module, settings: TensorParallelSettings, rng: RNGTracker | None = None
                ) -> tuple[dict[str, Any], str]:
    """(plan, where it came from)."""
    if settings.partition_config and settings.partition_config.get("layer_specs"):
        return plan_from_deepspeed(model, settings.partition_config), "tensor_parallel.partition_config"
    if _is_demo_gpt(model):
        return gpt_plan(sequence_parallel=settings.sequence_parallel, rng=rng), "the built-in GPT plan"
    if _is_demo_moe_gpt(model):
        return moe_gpt_plan(model, sequence_parallel=settings.sequence_parallel, rng=rng), "the built-in MoE GPT plan"
    if getattr(getattr(model, "config", None), "model_type", None) == "gpt2":  # Hugging Face GPT-2
        return hf_gpt2_plan(model, sequence_parallel=settings.sequence_parallel), "the built-in GPT-2 plan"
    if getattr(getattr(model, "config", None), "base_model_tp_plan", None):
        return (hf_llama_plan(model, sequence_parallel=settings.sequence_parallel),
                f"{type(model).__name__}'s base_model_tp_plan")
    raise PlanError(f"tensor parallelism of degree {settings.degree} needs a plan for {type(model).__name__}: give "
                    "tensor_parallel.partition_config.layer_specs in the config, or call "
                    "zerodist.tensor_parallel.parallelize(model, plan, topology) before initialize()")


def _apply_domino(model: nn.Module, topology: Topology, settings: TensorParallelSettings,
                  source: nn.Module | None = None) -> None:
    """The demo GPT's blocks by their residual branches; any other model's blocks (found from its
    structure: `find_blocks`) by their own forward, the chunks taking turns. `source`: the model a
    pipeline stage module `model` was cut from ([Note: Domino per stage])."""
    assert settings.domino is not None
    demo = _is_demo_gpt(source if source is not None else model)
    # the MoE GPT's blocks return (hidden, balance loss): the loss joins as the mean of the chunks' own
    # ([Note: Domino's scalar join] in domino.py); any other model's 0-dim block output is refused
    scalar_join = "mean" if _is_demo_moe_gpt(source if source is not None else model) else None
    region = TensorRegion.of(topology)
    if source is not None:
        for container, names in stage_blocks(model):
            _domino_in_place(container, names, gpt_block_branches if demo else None, region, settings.domino,
                             scalar_join)
        return
    if demo:
        gpt_domino(model, topology, settings.domino)
        return
    try:
        blocks = find_blocks(model)
    except ValueError as error:
        raise PlanError(str(error)) from None
    apply_domino(blocks, None, region, settings.domino, scalar_join=scalar_join)


# [Note: Domino per stage] A pipeline stage module (zerodist.pipe.split_model's) holds the blocks of
# its stages under the model's names (`blocks.2`) in containers of its own, and runs each block as
# one pipeline layer, in order, each on the previous one's output. So Domino applies per stage: the
# blocks of one stage are one chain, whose last block joins its chunks (what a stage sends, or what
# the final norm reads, is a tensor), and inter-layer overlap runs between the blocks of a stage.
# A rank with several stages (interleaved) has one chain per stage. The stage module runs each
# block by looking it up by name, so a block swapped in the container is the one that runs.
def stage_blocks(model: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """Per stage this rank holds, (the container of the blocks, the names in it of the stage's
    blocks in order), read from a split stage module's surface: `plan.blocks` (the blocks' dotted
    name), `local_stages`, `stage_modules(stage)`."""
    plan, stage_modules = getattr(model, "plan", None), getattr(model, "stage_modules", None)
    blocks_name = getattr(plan, "blocks", None)
    if not isinstance(blocks_name, str) or stage_modules is None:
        raise PlanError(f"Domino needs the blocks of each pipeline stage; {type(model).__name__} does not say where "
                        "they are (a zerodist.pipe.split_model stage module does)")
    if getattr(model, "activation_checkpoint_interval", 0):
        raise PlanError("Domino inside a pipeline stage with activation checkpointing: a checkpointed run of layers "
                        "would cut a chain of Domino blocks; set the pipeline's activation_checkpoint_interval to 0")
    try:
        container = model.get_submodule(blocks_name)
    except AttributeError:
        return []  # a stage module with no block on this rank (only the embedding, or the head)
    result = []
    for stage in model.local_stages:  # type: ignore[union-attr]
        held = {id(module) for module in stage_modules(stage)}
        names = sorted((name for name, child in container.named_children() if id(child) in held), key=int)
        if names:
            result.append((container, names))
    return result


def _domino_in_place(container: nn.Module, names: list[str], branches: Any, region: TensorRegion,
                     config: DominoConfig, scalar_join: str | None = None) -> None:
    chain = nn.ModuleList([container.get_submodule(name) for name in names])
    apply_domino(chain, branches, region, config, scalar_join=scalar_join)
    for name, block in zip(names, chain):
        setattr(container, name, block)


@dataclasses.dataclass(frozen=True)
class TensorParallelState:
    """What tensor parallelism did to one part: the part state surface of zerodist/comm/parts.py."""

    module: nn.Module
    degree: int
    source: str  # where the plan came from; "" when nothing was converted here
    converted_here: bool = False  # the engine applied the plan (so destroy() undoes its scopes)

    def to_logical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (the part's `state_dict()`, whole parameters) with every slice gathered over the
        tensor axis: the keys and shapes of the unparallelized model (collective)."""
        result = dict(state)
        for key, (spec, region) in sliced_parameters(self.module).items():
            result[key] = unslice_tensor(state[key], spec, region)
        return result

    def from_logical(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict of the unparallelized model cut to this rank's slices (no collective)."""
        result = dict(state)
        for key, (spec, region) in sliced_parameters(self.module).items():
            if key in result:
                result[key] = slice_tensor(result[key], spec, region)
        return result

    def report(self) -> list[str]:
        return [f"tensor parallel: degree {self.degree} from {self.source}"] if self.source else []

    def remove_hooks(self) -> None:
        """The shared-input scopes' hooks on the user's attention and MLP modules come off; the
        converted layers are the model's now (they stay after `destroy()`) and reduce for
        themselves. A model the user parallelized keeps what the user's `parallelize()` attached."""
        if self.converted_here:
            detach_shared_inputs(self.module)


def apply_tensor_parallel(model: nn.Module, topology: Topology, settings: TensorParallelSettings, *,
                          conversion: contextlib.AbstractContextManager[Any] | None = None,
                          plan_for: nn.Module | None = None) -> TensorParallelState:
    """Parallelize `model` over `topology`'s tensor axis (in place); its part state (`.module`).

    `conversion` surrounds the swapping of layers (and nothing else): the engine passes ZeRO's
    `continue_recording(model)` so that a model built under `zerodist.zero.Init()` has its slices
    cut on the meta device and recorded, to be replayed when ZeRO materialises it. `plan_for`: the
    model whose plan to pick when `model` is a part of it that keeps its names (a pipeline stage
    that `zerodist.pipe.split_model` cut from it); the plan's names then match the part's."""
    existing = _existing_degree(model)
    if existing is not None:
        if existing != topology.size("tensor"):
            raise PlanError(f"the model was parallelized at tensor degree {existing}, but the config asks for "
                            f"{topology.size('tensor')}")
        return TensorParallelState(model, existing, "the model's own layers (parallelized before initialize)")
    if settings.degree == 1:
        if settings.domino is not None or settings.sequence_parallel:
            raise PlanError("zerodist.tensor_parallel.domino / sequence_parallel need a tensor degree above 1 "
                            "(tensor_parallel.autotp_size)")
        return TensorParallelState(model, 1, "")
    if settings.domino is not None and settings.domino.overlap == "inter" and \
            _is_demo_moe_gpt(plan_for if plan_for is not None else model):  # on every rank, before any collective
        raise PlanError('Domino\'s "overlap": "inter" on the demo MoE GPT: its blocks return (hidden, balance loss), '
                        'and inter-layer overlap passes a tensor from block to block; use "overlap": "intra"')
    # Dropout streams: `replicated` equal on the tensor ranks, `sharded` different (attention heads);
    # seeded from this process's torch seed, which every rank sets alike to build the same model.
    rng = tensor_parallel_rng(topology, seed=torch.initial_seed())
    attach_rng_tracker(model, rng)
    plan, source = choose_plan(plan_for if plan_for is not None else model, settings, rng)
    if plan_for is not None:  # the part holds some of the model's modules: the entries for the others stay out
        # ties are the whole model's: a stage holding only an embedding its head (on another stage) shares
        # refuses as that stage does, on every rank ([Note: tied slices] in zerodist/pipe/apply.py)
        _check_ties(plan_for, _match(plan_for, plan))
        names = [name for name, _ in model.named_modules() if name]
        plan = {pattern: entry for pattern, entry in plan.items() if any(fnmatch.fnmatchcase(n, pattern) for n in names)}
    with conversion if conversion is not None else contextlib.nullcontext():
        parallelize(model, plan, topology, sequence_parallel=settings.sequence_parallel)
    if settings.domino is not None:
        # [Note: Domino at ZeRO-3] in plans.py / domino.py: the demo GPT's blocks finish in the next block
        # with a copy of the bias, and hand their chunks on as a pytree ZeRO-3 sees
        if settings.domino.overlap == "inter" and settings.sharded_parameters and not pytree_registration_available:
            raise PlanError("Domino's inter-layer overlap at ZeRO stage 3 needs torch.utils._pytree.register_pytree_"
                            "node (absent from this torch), so that ZeRO-3 sees a block's chunked output; use "
                            '"overlap": "intra" at stage 3, or stages 0-2')
        _apply_domino(model, topology, settings, plan_for)
    log_rank0(logger, "tensor parallel: degree %d from %s%s%s", topology.size("tensor"), source,
              ", sequence parallel" if settings.sequence_parallel else "",
              f", Domino {settings.domino.chunks} chunks ({settings.domino.overlap})" if settings.domino else "")
    return TensorParallelState(model, topology.size("tensor"), source, converted_here=True)
