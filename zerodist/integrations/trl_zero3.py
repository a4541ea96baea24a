"""TRL at ZeRO-3 under ``zerodist run --as-deepspeed``: the one question TRL asks each parameter.

[Note: TRL's lm-head gather under the served ZeRO-3]
TRL (1.x) computes its SFT loss with a fused LM head (``add_fused_lm_head``: the model's forward is
given a ``fused_lm_head=True`` path that reads ``lm_head.weight`` directly, without calling the
``lm_head`` module). Under DeepSpeed's ZeRO-3 that weight may be partitioned at that moment, so TRL's
``trl.trainer.utils.maybe_gather_lm_head_ctx(weight, bias)`` gathers it first, and it decides which
parameters need the gather by reading DeepSpeed's per-parameter attribute:
``p.ds_status != ZeroParamStatus.AVAILABLE``. Every SFT loss path reaches it (``model(**inputs,
fused_lm_head=True)`` in ``SFTTrainer.compute_loss``; the chunked log-prob and divergence kernels too),
and only when ``is_deepspeed_zero3_enabled()``. zerodist sets no attribute on parameters (a design
rule), so there the read is ``AttributeError: 'Parameter' object has no attribute 'ds_status'``.

The question has an answer in zerodist's side table: ``zerodist.zero.registry.is_sharded(p)`` is
``ds_status != AVAILABLE``. When zerodist serves ``import deepspeed``, the import of
``trl.trainer.utils`` is completed (its loader wrapped, as ``accelerate_on_cpu`` does for
``accelerate.state``) by replacing that one function with the same function asking the side table
instead; the gather itself is zerodist's ``GatheredParameters`` (the served ``deepspeed.zero``'s, for
parameters an engine holds). Nothing else of TRL
changes, and nothing is written on any parameter. A TRL without the function is left as it is.

[Note: TRL's generation under the served ZeRO-3]
GRPO (and the other trainers that sample) generate inside ``trl.models.utils``'s
``_unwrap_model_for_generation``: at ZeRO-3 it gathers the whole model with
``deepspeed.zero.GatheredParameters(model.parameters())``, then calls ``remove_hooks(model)`` before
generating and ``add_hooks(model)`` after, which take DeepSpeed's stage-3 hooks off and put them back
through its optimizer's internals (``model.optimizer.parameter_offload``, ``.module``,
``.forward_hooks``, ``_register_deepspeed_module``). zerodist's engine has none of these, so GRPO at
ZeRO-3 stopped there (``'ZeroOptimizer' object has no attribute 'module'``). Nothing needs taking off
in zerodist: while ``GatheredParameters`` holds every parameter, its units' hooks find them gathered and
gather nothing. So the served import of ``trl.models.utils`` replaces the two functions with ones that
leave a zerodist engine as it is and call TRL's own for anything else.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
from typing import Any

from zerodist.integrations import import_patch
from zerodist.utils import get_logger, log_rank0

logger = get_logger(__name__)

MODULE = "trl.trainer.utils"
FUNCTION = "maybe_gather_lm_head_ctx"
GENERATION_MODULE = "trl.models.utils"
GENERATION_HOOKS = ("remove_hooks", "add_hooks")
_PATCHED = "_zerodist_side_table"
_SAID: set[str] = set()  # the one line saying the gather ran, once per process


def patched_spec(finder: Any, fullname: str, path: Any, target: Any) -> importlib.machinery.ModuleSpec | None:
    """`trl.trainer.utils`'s or `trl.models.utils`'s own spec, its loader wrapped to replace what zerodist
    answers differently after it runs."""
    return import_patch.patched_spec(finder, fullname, path, target, PATCHES[fullname])


def replace_generation_hooks(module: Any) -> None:
    """Give `module` (trl.models.utils) a `remove_hooks` and an `add_hooks` that leave a zerodist engine as
    it is ([Note: TRL's generation under the served ZeRO-3]) and call TRL's own for any other model."""
    for name in GENERATION_HOOKS:
        original = getattr(module, name, None)
        if original is None or getattr(original, _PATCHED, False):
            continue

        def hook(model: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            from zerodist.engine import Engine

            if isinstance(model, Engine):
                return None  # its units' hooks gather nothing while GatheredParameters holds every parameter
            return _original(model, *args, **kwargs)

        functools.update_wrapper(hook, original)
        setattr(hook, _PATCHED, True)
        setattr(module, name, hook)


def replace_lm_head_gather(module: Any) -> None:
    """Give `module` (trl.trainer.utils) a `maybe_gather_lm_head_ctx` that asks zerodist's side table."""
    original = getattr(module, FUNCTION, None)
    if original is None or getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def maybe_gather_lm_head_ctx(*params: Any) -> contextlib.AbstractContextManager[Any]:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if not is_deepspeed_zero3_enabled():
            return contextlib.nullcontext()
        return gather_if_sharded(*params)

    setattr(maybe_gather_lm_head_ctx, _PATCHED, True)
    setattr(module, FUNCTION, maybe_gather_lm_head_ctx)


def gather_if_sharded(*params: Any) -> contextlib.AbstractContextManager[Any]:
    """TRL's rule with zerodist's answer: gather the given parameters that are sharded now (each once, by
    identity; None ignored), or a null context when none is."""
    from zerodist.zero import GatheredParameters
    from zerodist.zero.registry import is_sharded

    to_gather = {id(p): p for p in params if p is not None and is_sharded(p)}
    if "asked" not in _SAID:  # once per process: a log shows that TRL's question reached the side table
        _SAID.add("asked")
        log_rank0(logger, f"TRL's lm-head gather (trl.trainer.utils.{FUNCTION}) asked zerodist's side table: "
                          f"{len(to_gather)} of {sum(p is not None for p in params)} parameter(s) sharded now, "
                          "gathered by zerodist's GatheredParameters (the rest are whole at this point); said once")
    if not to_gather:
        return contextlib.nullcontext()
    return GatheredParameters(list(to_gather.values()))


# The TRL modules the served import completes, and how.
PATCHES = {MODULE: replace_lm_head_gather, GENERATION_MODULE: replace_generation_hooks}
