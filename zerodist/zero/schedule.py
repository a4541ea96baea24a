"""The default schedule: module and optimizer hooks that call the unit runtime's verbs.

    forward:  root pre-hook    gather the root (and prefetch the first units), or only wait for
                               what the last step gathered early ([Note: early gather] in runtime.py);
                               wait for the root's and the persistent groups' post-step gathers
              unit pre-hook    gather the unit (and prefetch the next); stages 1/2: wait for its
                               post-step gathers ([Note: overlapped parameter gather])
              unit post-hook   free it (not a unit kept for its backward: [Note: reuse between
                               forward and backward], nor one recomputed inside a backward by
                               activation checkpointing), arm its backward pre-hook; for an output
                               the unit still computes (Domino's inter overlap), both once it
                               has finished ([Note: unfinished outputs] in utils/unfinished.py)
    backward: unit pre-hook    (first gradient reaching the unit's outputs) gather it again if
                               freed, prefetch the units before it
              bucket complete  reduce-scatter (the reducer), free the unit once all its buckets are
    end of backward            free everything still gathered (the root, units with unused parameters)
    optimizer step  pre-hook   finish the last step's gathers, reduce what was deferred, free units
                    post-hook  gather the updated parameters (stages 1/2, persistent groups) and,
                               with sharded parameters, the next forward's first units

Every hook goes through PyTorch's own registration API (module hooks, `register_multi_grad_hook`,
`saved_tensors_hooks`); no attribute is set on any module or parameter. The hooks hold the
runtime weakly: they live on the user's modules and autograd nodes, and must not keep the
runtime's buffers alive.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from zerodist import compat
from zerodist.compat import tree_flatten
from zerodist.utils.unfinished import UnfinishedOutput
from zerodist.zero import sharded_access
from zerodist.zero.optimizer import ZeroOptimizer
from zerodist.zero.runtime import BACKWARD, FORWARD, UnitRuntime
from zerodist.zero.saved_params import SavedParameterViews
from zerodist.zero.units import Unit


class DefaultSchedule:
    """Forward, backward, step: the moments at which the runtime gathers, frees and reduces."""

    def __init__(self, runtime: UnitRuntime, optimizer: ZeroOptimizer):
        self.runtime = runtime
        me = weakref.ref(runtime)
        self._handles: list[Any] = []
        if runtime.shards_parameters:
            self._hook_sharded_units(runtime, me)
        if runtime.overlap and runtime.gather_groups:
            modules = [u.module for u in runtime.units]
            for index in sorted(runtime.gathers_by_unit):
                self._handles.append(modules[index].register_forward_pre_hook(
                    functools.partial(_wait_updated, me, index)))
        self._handles.append(optimizer.register_step_pre_hook(functools.partial(_call, me, "before_step")))
        self._handles.append(optimizer.register_step_post_hook(functools.partial(_call, me, "after_step")))

    def _hook_sharded_units(self, runtime: UnitRuntime, me: weakref.ref[UnitRuntime]) -> None:
        root = runtime.root
        self._handles.append(root.module.register_forward_pre_hook(functools.partial(_pre_forward_root, me)))
        for unit in runtime.order:
            unit_ref = weakref.ref(unit)
            self._handles.append(unit.module.register_forward_pre_hook(functools.partial(_pre_forward, me, unit_ref)))
            self._handles.append(unit.module.register_forward_hook(functools.partial(_post_forward, me, unit_ref)))
            if unit.index in runtime.frozen_units:  # freed in backward once its inputs' gradients are in too
                self._handles.append(unit.module.register_forward_hook(
                    functools.partial(_await_inputs, me, unit_ref), with_kwargs=True))
            if unit.index not in runtime.kept:  # freed after forward: [Note: saved parameter views]
                views = SavedParameterViews(functools.partial(_gather_for_backward, me, unit_ref))
                # its pre-hook runs after the gather above
                self._handles.append(unit.module.register_forward_pre_hook(lambda _m, _a, v=views, u=unit: v.enter(u)))
                self._handles.append(unit.module.register_forward_hook(lambda _m, _a, _o, v=views: v.leave(),
                                                                       always_call=True))

    def end_backward(self) -> None:
        """Autograd returned: the reducer syncs what is left (or keeps it, deferring), and every unit
        still gathered is freed (unless a caller drives the runtime). The engine's one call."""
        self.runtime.reducer.end_backward()
        if self.runtime.shards_parameters:
            self.runtime.end_backward()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _call(runtime_ref: weakref.ref[UnitRuntime], method: str, *args: Any) -> None:
    runtime = runtime_ref()
    if runtime is not None:
        getattr(runtime, method)()


def _record_run(runtime: UnitRuntime, unit: Unit) -> None:
    if torch.is_grad_enabled():  # a forward that a backward (and a step) may follow
        runtime.runs.record(unit)


def _pre_forward_root(runtime_ref: weakref.ref[UnitRuntime], module: torch.nn.Module, args: Any) -> None:
    runtime = runtime_ref()
    if runtime is None:
        return
    _record_run(runtime, runtime.root)
    if runtime.take_early_gathers():  # the step issued this forward's first gathers: only wait
        runtime.gather_for(runtime.root, FORWARD)
    else:
        runtime.gather_for(runtime.root, FORWARD, prefetch_step=+1)


def _pre_forward(runtime_ref: weakref.ref[UnitRuntime], unit_ref: weakref.ref[Unit], module: torch.nn.Module,
                 args: Any) -> None:
    runtime, unit = runtime_ref(), unit_ref()
    if runtime is not None and unit is not None:
        _record_run(runtime, unit)
        runtime.gather_for(unit, FORWARD, prefetch_step=+1)


def _post_forward(runtime_ref: weakref.ref[UnitRuntime], unit_ref: weakref.ref[Unit], module: torch.nn.Module,
                  args: Any, output: Any) -> None:
    finish = functools.partial(_finished_forward, runtime_ref, unit_ref, torch.is_grad_enabled(),
                               compat.in_backward_pass(strict=False))
    if isinstance(output, UnfinishedOutput):  # the block runs on: [Note: unfinished outputs] in utils/unfinished.py
        output.when_finished(finish)
        return
    # kept whole (Domino's stream is also a pytree node, whose leaves are its chunks)
    leaves = tree_flatten(output, is_leaf=lambda node: isinstance(node, UnfinishedOutput))[0]
    pending = [leaf for leaf in leaves if isinstance(leaf, UnfinishedOutput)]
    if not pending:
        finish(leaves)
        return
    # a unit that returns such outputs inside a container (a wrapper's `(stream,)`): done when all are
    collected, left = [leaf for leaf in leaves if not isinstance(leaf, UnfinishedOutput)], [len(pending)]

    def one_finished(outputs: list[Any]) -> None:
        collected.extend(outputs)
        left[0] -= 1
        if left[0] == 0:
            finish(collected)

    for leaf in pending:
        leaf.when_finished(one_finished)


def _finished_forward(runtime_ref: weakref.ref[UnitRuntime], unit_ref: weakref.ref[Unit], grad_enabled: bool,
                      recompute: bool, outputs: list[Any]) -> None:
    """The unit's forward is done (its forward hook ran, or its unfinished output finished).
    `grad_enabled` and `recompute` (the forward ran inside a backward pass) are read when it ran."""
    runtime, unit = runtime_ref(), unit_ref()
    if runtime is None or unit is None:
        return
    tensors = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
    backward_follows = bool(tensors) and grad_enabled
    # A forward inside a backward pass is an activation-checkpoint recompute: its own backward runs
    # next, so the unit stays gathered until its gradients are in, as a kept unit does (freeing it
    # here gathered it once more): `hold_recomputed` says when.
    if not (backward_follows and (unit.index in runtime.kept or (recompute and runtime.hold_recomputed(unit)))):
        runtime.release(unit)
    if backward_follows:
        # Weak: the hook lives on the outputs' autograd nodes, which a module may keep (MoE layers
        # keep gate outputs); a strong closure there would keep this runtime and its shards alive
        # through a cycle Python's collector cannot see (it runs through C++).
        torch.autograd.graph.register_multi_grad_hook(
            tensors, functools.partial(_pre_backward, runtime_ref, unit_ref), mode="any")


def _await_inputs(runtime_ref: weakref.ref[UnitRuntime], unit_ref: weakref.ref[Unit], module: torch.nn.Module,
                  args: Any, kwargs: Any, output: Any) -> None:
    """A unit with frozen groups ran forward: its backward reads the frozen weights until the
    gradients of every input that needs one are computed ([Note: frozen parameters at stage 3] in
    apply.py). Inputs that need none: nothing upstream waits, its trained buckets decide alone."""
    runtime, unit = runtime_ref(), unit_ref()
    if runtime is None or unit is None or not torch.is_grad_enabled():
        return
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if inputs:
        runtime.await_inputs(unit)
        torch.autograd.graph.register_multi_grad_hook(
            inputs, functools.partial(_inputs_done, runtime_ref, unit_ref), mode="all")


def _inputs_done(runtime_ref: weakref.ref[UnitRuntime], unit_ref: weakref.ref[Unit], grads: Any) -> None:
    runtime, unit = runtime_ref(), unit_ref()
    if runtime is not None and unit is not None:
        runtime.inputs_done(unit)


def _pre_backward(runtime_ref: weakref.ref[UnitRuntime], unit_ref: weakref.ref[Unit], grads: Any) -> None:
    runtime, unit = runtime_ref(), unit_ref()
    if runtime is not None and unit is not None:
        runtime.backward_started(unit)
        runtime.gather_for(unit, BACKWARD, prefetch_step=-1)


def _gather_for_backward(runtime_ref: weakref.ref[UnitRuntime], unit_ref: weakref.ref[Unit]) -> None:
    """A saved view found its unit freed (an activation-checkpoint recompute): gather it again."""
    runtime, unit = runtime_ref(), unit_ref()
    if runtime is None or unit is None:
        raise RuntimeError("ZeRO-3: a saved parameter view outlived its engine; run backward before "
                           "destroying the engine")
    runtime.gather_for(unit, BACKWARD)


def _wait_updated(runtime_ref: weakref.ref[UnitRuntime], index: int, module: torch.nn.Module, args: Any) -> None:
    runtime = runtime_ref()
    if runtime is not None:
        runtime.wait_unshard([runtime.units[index]])  # its post-step gathers (the root's: persistent ones too)
        sharded_access.settle()  # the last wait of this forward: the check has nothing more to do
