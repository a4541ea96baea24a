"""NaN/Inf hunt: which rank, and which module output, loss or parameter gradient went first.

    hunter = NanHunter(engine)      # or config {"zerodist": {"debug": {"nan_check": true}}}
    loss = engine(batch); engine.backward(loss)
    hunter.check(loss)              # the engine does this itself when nan_check is on

A NaN shows up everywhere downstream of where it was born: a NaN in one layer's output makes
the loss NaN, every gradient NaN, and after the gradient reduction every rank's parameters
NaN. What helps is the *first* one, on the rank where it was born. So the hunter looks, on
each rank, in the order things happen:

1. forward (`forward=True`): every module's output as it completes, through PyTorch's
   `register_forward_hook`; the first module whose output is non-finite, and whether its
   inputs already were (then the value came from code between modules, or the batch);
2. the loss;
3. gradients: each parameter's local gradient in backward order, before the reduction mixes
   ranks (the engine's reducer hands every gradient to its observers before bucketing it; a
   plain model gets a tensor hook per parameter).

Checks are queued on the device as each tensor's min and max (see [Note: extremes]) and read
once per `check()` (one host transfer), then one
all_reduce of a flag makes every rank agree: all of them raise `NonFiniteError` together, with
the same message naming the rank that went first (earliest phase, then earliest position,
then lowest rank) and what each rank saw. Nothing is set on modules or parameters; `close()`
removes the hooks.

With fp16 loss scaling, gradient overflow is expected (the scaler skips the step), so
gradients are not checked there unless asked (`gradients=True`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import torch

import zerodist.comm as comm
from zerodist.comm import Group
from zerodist.utils import get_logger
from zerodist.zero.flat_group import FlatParamGroup
from zerodist.zero.state import ZeroState, zero_state_of

logger = get_logger(__name__)

PHASES = ("forward", "loss", "gradient")


class NonFiniteError(FloatingPointError):
    """Raised on every rank when any rank saw a NaN or Inf; `.findings` has each rank's."""

    def __init__(self, message: str, findings: list[Finding]):
        super().__init__(message)
        self.findings = findings


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one rank saw: the first non-finite value (`phase`, `where`), counts per phase."""

    rank: int
    phase: str
    position: int
    where: str
    detail: str
    counts: tuple[int, int, int]  # non-finite forward outputs, losses, gradients
    totals: tuple[int, int, int]  # checked forward outputs, losses, gradients

    def sort_key(self) -> tuple[int, int, int]:
        return PHASES.index(self.phase), self.position, self.rank

    def describe(self) -> str:
        parts = [f"rank {self.rank}: first {self.where} {self.detail}"]
        for name, count, total in zip(("module outputs", "loss", "gradients"), self.counts, self.totals):
            if total:
                parts.append(f"{count} of {total} {name} non-finite")
        return "; ".join(parts)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() or obj.is_complex() else []
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _extremes(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Each tensor's min and max, concatenated, on the device (no host sync); None for none.

    [Note: extremes] A tensor holds a NaN or an Inf exactly when its min or max is non-finite
    (NaN propagates through min/max; +-Inf is an extreme; finite values never overflow, unlike
    a sum). `aminmax` reads the tensor once and allocates nothing of its size: ~6x cheaper
    than `isfinite(t).all()` on CPU, which materialises a boolean tensor first."""
    parts = []
    for t in tensors:
        t = t.detach()
        if t.numel() == 0:
            continue
        if t.is_complex():
            t = torch.view_as_real(t)
        parts.append(torch.stack(torch.aminmax(t)).float())
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _all_finite(values: list[torch.Tensor]) -> list[bool]:
    """Whether each of `values` is all finite, with one host transfer for all of them."""
    if not values:
        return []
    flat = torch.cat([v.reshape(-1) for v in values]).cpu()
    finite, start = [], 0
    for v in values:
        finite.append(bool(torch.isfinite(flat[start:start + v.numel()]).all()))
        start += v.numel()
    return finite


class NanHunter:
    """Find the first NaN/Inf of a step (see the module docstring). Takes a zerodist engine
    (its typed `zero_state`), a `ZeroState`, or a plain `torch.nn.Module`. `check()` is a collective over `group`
    (default: the whole world, since every rank must stop)."""

    def __init__(self, model_or_engine: torch.nn.Module | ZeroState, *, forward: bool = True,
                 gradients: bool | None = None, group: Group = None):
        self.zero = zero_state_of(model_or_engine)
        # an engine's public step counters, for the message (a ZeroState or a module has none)
        self.engine = model_or_engine if self.zero is not None and self.zero is not model_or_engine else None
        module = self.zero.module if self.zero is not None else cast(torch.nn.Module, model_or_engine)
        if gradients is None:
            gradients = self.zero is None or not self.zero.precision.loss_scaling
        self.group = group
        self._forward: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # name, extremes of inputs, of output
        self._grads: list[tuple[str, torch.Tensor]] = []
        self._handles: list[Any] = []
        self._observer = None
        if forward:
            self._handles.append(module.register_forward_pre_hook(self._on_root_forward))
            for name, sub in module.named_modules():
                label = f"'{name or '(root)'}' ({type(sub).__name__})"
                self._handles.append(sub.register_forward_hook(functools.partial(self._on_output, label)))
        if gradients and self.zero is not None:
            self._observer = self._on_engine_grad
            self.zero.reducer.grad_observers.append(self._observer)
        elif gradients:
            for name, param in module.named_parameters():
                if param.requires_grad:
                    self._handles.append(param.register_hook(functools.partial(self._on_grad, name)))

    # -------------------------------------------------------------- observers (no host sync)
    def _on_root_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._forward.clear()  # a new forward: what the previous one left is no longer "first"

    def _on_output(self, label: str, module: torch.nn.Module, args: Any, output: Any) -> None:
        out = _extremes(_tensors(output))
        if out is not None:
            inputs = _extremes(_tensors(args))
            self._forward.append((label, out.new_zeros(0) if inputs is None else inputs, out))

    def _on_engine_grad(self, group: FlatParamGroup, index: int, grad: torch.Tensor) -> None:
        self._on_grad(group.records[index].name, grad)

    def _on_grad(self, name: str, grad: torch.Tensor) -> None:
        extremes = _extremes([grad])
        if extremes is not None:
            self._grads.append((name, extremes))

    # -------------------------------------------------------------- the check
    def check(self, loss: torch.Tensor | None = None) -> None:
        """After backward: raise `NonFiniteError` on every rank if any rank saw a NaN/Inf since
        the last forward. Collective (one scalar all_reduce; an all_gather_object on failure)."""
        finding = self._local_finding(loss)
        self._forward.clear()
        self._grads.clear()
        device = loss.device if isinstance(loss, torch.Tensor) else comm.device_for_rank()
        flag = torch.tensor([0.0 if finding is None else 1.0], device=device)
        comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self.group)
        if flag.item() == 0:
            return
        everyone: list[Any] = [None] * comm.get_world_size(self.group)
        comm.all_gather_object(everyone, finding, group=self.group)
        found = sorted((f for f in everyone if f is not None), key=Finding.sort_key)
        clean = [r for r, f in enumerate(everyone) if f is None]
        raise NonFiniteError(self._message(found, clean), found)

    def _local_finding(self, loss: torch.Tensor | None) -> Finding | None:
        forward = self._forward
        finite = _all_finite([out for _, _, out in forward] + [g for _, g in self._grads])
        loss_bad = loss is not None and not bool(torch.isfinite(loss.detach()).all())
        bad_forward = [i for i, ok in enumerate(finite[:len(forward)]) if not ok]
        bad_grads = [i for i, ok in enumerate(finite[len(forward):]) if not ok]
        counts = (len(bad_forward), int(loss_bad), len(bad_grads))
        totals = (len(forward), int(loss is not None), len(self._grads))
        rank = comm.get_rank()
        if bad_forward:
            i = bad_forward[0]
            label, inputs, _ = forward[i]
            origin = ("(its inputs were already non-finite: the value came from code between modules, "
                      "or from the batch)" if not _all_finite([inputs])[0] else "(its inputs were finite)")
            return Finding(rank, "forward", i, f"non-finite forward output: module {label}", origin, counts, totals)
        if loss_bad:
            assert loss is not None  # loss_bad says so
            return Finding(rank, "loss", 0, "non-finite loss:", f"{loss.detach().float().item()}", counts, totals)
        if bad_grads:
            i = bad_grads[0]
            return Finding(rank, "gradient", i, f"non-finite gradient: '{self._grads[i][0]}'",
                           f"(#{i + 1} in backward order, before reduction)", counts, totals)
        return None

    def _message(self, found: list[Finding], clean: list[int]) -> str:
        first = found[0]
        where = ""
        if self.engine is not None:
            where = (f" at micro-step {getattr(self.engine, 'micro_steps', '?')} "
                     f"(optimizer step {getattr(self.engine, 'global_steps', '?')})")
        lines = [f"NaN/Inf found{where} on rank(s) {', '.join(str(f.rank) for f in found)}; rank {first.rank} went "
                 f"first: {first.where} {first.detail}"]
        lines += [f"  {f.describe()}" for f in found]
        if clean:
            lines.append(f"  rank(s) {', '.join(map(str, clean))}: all finite")
        return "\n".join(lines)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._observer is not None and self.zero is not None:
            observers = self.zero.reducer.grad_observers
            if self._observer in observers:
                observers.remove(self._observer)
            self._observer = None
