"""Where a training step's memory goes, on one rank (used by train_bench.py's phase 1).

Resident set size (RSS) is read from /proc/self/status: `VmRSS` now and `VmHWM`, its high-water
mark, which writing "5" to /proc/self/clear_refs resets (Linux 4.0+), so that the peak of the
training steps is not the peak of building the model. One extra step then splits that peak:

- baseline: RSS before the model is built (interpreter, torch, the framework's own imports,
  the process group, the benchmark's batches), after one plain training step of a tiny GPT
  (`warm_up_kernels`), so that the code pages and thread pools any first step brings in are
  counted here and not in the rest;
- model states: parameters, gradients and optimizer state that live between steps (zerodist: its
  own accounting, `engine.model_state_bytes()`; others: the distinct tensor storages reachable from
  them, see train_bench.py);
- activations: the distinct storages autograd saved for backward during the forward
  (`torch.autograd.graph.saved_tensors_hooks`), parameters excluded, at the end of the forward;
- gathered parameters: parameter storage that exists only during the step (stage 3's all-gathered
  units, FSDP2's unsharded parameters, DeepSpeed's gathered partitions): the distinct storages the
  module's parameters point at, less those they pointed at between steps, together with those
  that autograd still holds because a parameter was saved for backward (a Linear saves its weight,
  which keeps a resharded unit's gathered storage alive until backward) and, for zerodist, its
  stage-3 groups' full buffers (prefetched ones included); the largest seen at any saved-tensor
  pack (forward) or unpack (backward);
- gradient staging (zerodist): the buckets' transient full-size gradient buffers (stages 2-3)
  that are reduce-scattered into the shard, the largest seen at those same points;
- communication buffers (zerodist stage 3): its buffer pool ([Note: buffer pool] in
  zerodist/zero/buffer_pool.py), where gathered units and staging buffers come from and go back
  to, at its largest: the gathered parameters and staging above are parts of it that are not all
  alive at the same point (a unit's buffer freed in backward is the next bucket's staging buffer);
- the rest: the training peak less all of the above (autograd's gradients before they reach a
  bucket, temporaries of the kernels, the allocator's free but unreturned memory). To tell live
  memory from memory malloc holds but has not handed out, the largest heap in use (glibc
  `mallinfo2()`, zerodist.debug.memory.heap_in_use) at the same points is recorded above its
  value at the baseline: `heap_peak`. The training peak less the baseline less that is memory
  the allocator kept (free lists, fragmentation) or that lived only between two samples.

Sampling at pack/unpack points misses buffers that live only between two of them; the rest says
how much is not explained.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

from zerodist.debug.memory import heap_in_use

_STATUS_FIELD = re.compile(r"^(VmRSS|VmHWM):\s+(\d+) kB", re.MULTILINE)


def rss_status() -> dict[str, int]:
    """{"VmRSS": bytes now, "VmHWM": peak bytes since start or the last reset}."""
    with open("/proc/self/status") as status:
        return {name: int(kib) * 1024 for name, kib in _STATUS_FIELD.findall(status.read())}


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def warm_up_kernels() -> None:
    """One plain forward, backward, clip and AdamW step of the tiny GPT (freed afterwards)."""
    import torch

    from zerodist.models import GPT, gpt_config

    model = GPT(gpt_config("tiny"))
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, model.config.vocab_size, (2, model.config.seq_len))
    model(tokens, tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def _local(tensor: Any) -> Any:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor: this rank's shard


def parameter_storages(module: Any) -> dict[int, int]:
    """data_ptr -> bytes of the distinct storages `module`'s parameters point at now."""
    from zerodist.zero.sharded_access import suspended

    storages = {}
    with suspended():  # reading a ZeRO-3 placeholder's (one-element) storage between steps is allowed here
        for param in module.parameters():
            storage = _local(param).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return storages


def _still_at(tensor: Any, ptr: int) -> bool:
    """Whether a saved tensor is alive and still on the storage it was saved with (a parameter
    saved as itself follows its `.data` when the unit is resharded; a view of it does not)."""
    from zerodist.zero.sharded_access import suspended

    if tensor is None:
        return False
    with suspended():
        return _local(tensor).untyped_storage().data_ptr() == ptr


def _zero_groups(trainer: Any) -> list[Any]:
    zero_state = getattr(getattr(trainer, "engine", None), "zero_state", None)
    return list(getattr(zero_state, "groups", []))


def _nbytes(tensor: Any) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def staging_bytes(trainer: Any) -> int:
    """Bytes of zerodist's transient gradient staging buffers alive now (0 for other frameworks)."""
    return sum(_nbytes(getattr(bucket, "staging", None)) for group in _zero_groups(trainer) for bucket in group.buckets)


def pool_bytes(trainer: Any) -> int:
    """Bytes zerodist's stage-3 buffer pools hold now, handed out or free (0 for other frameworks)."""
    pools = {id(p): p for p in (getattr(g, "buffer_pool", None) for g in _zero_groups(trainer)) if p is not None}
    return sum(p.allocated_bytes for p in pools.values())


def unsharded_storages(trainer: Any) -> dict[int, int]:
    """data_ptr -> bytes of zerodist's stage-3 full parameter buffers alive now, those still being
    gathered (prefetched, not yet pointed at by the parameters) included; empty for other frameworks."""
    buffers = [g.param_buffer for g in _zero_groups(trainer) if g.policy.shard_parameters and g.param_buffer is not None]
    return {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in buffers}


class StepSampler:
    """Samples the transient memory of one step at every saved-tensor pack and unpack."""

    def __init__(self, trainer: Any):
        self.trainer, self.module = trainer, trainer.model
        self.between_steps = set(parameter_storages(self.module))
        self.activations: dict[int, int] = {}  # storage data_ptr -> bytes, parameters excluded
        # Parameters saved for backward (a Linear saves its weight): after a unit is resharded they
        # keep its gathered storage alive until backward releases them. Weak: alive as long as autograd holds them.
        self.saved_params: list[tuple[weakref.ref[Any], int, int]] = []
        self.gathered_peak = self.staging_peak = self.heap_peak = self.pool_peak = 0

    def sample(self) -> dict[int, int]:
        self.heap_peak = max(self.heap_peak, heap_in_use() or 0)
        params = parameter_storages(self.module)
        gathered = {ptr: n for ptr, n in params.items() if ptr not in self.between_steps}
        gathered.update((ptr, n) for ref, ptr, n in self.saved_params if _still_at(ref(), ptr))
        gathered.update(unsharded_storages(self.trainer))
        self.gathered_peak = max(self.gathered_peak, sum(gathered.values()))
        self.staging_peak = max(self.staging_peak, staging_bytes(self.trainer))
        self.pool_peak = max(self.pool_peak, pool_bytes(self.trainer))
        return params

    def pack(self, tensor: Any) -> Any:
        params = self.sample()
        storage = _local(tensor).untyped_storage()
        ptr = storage.data_ptr()
        if ptr in params and ptr not in self.between_steps:
            self.saved_params.append((weakref.ref(tensor), ptr, storage.nbytes()))
        elif ptr not in params and ptr not in self.between_steps:
            self.activations[ptr] = storage.nbytes()
        return tensor

    def unpack(self, tensor: Any) -> Any:
        self.sample()
        return tensor


def measure_step(trainer: Any, inputs: Any, targets: Any) -> dict[str, int]:
    """Run one training step and return its transient memory by kind (see the module docstring)."""
    import torch

    sampler = StepSampler(trainer)
    with torch.autograd.graph.saved_tensors_hooks(sampler.pack, sampler.unpack):
        loss = trainer.forward(inputs, targets)
    activations = sum(sampler.activations.values())
    trainer.finish(loss)
    return {"activations": activations, "gathered_params": sampler.gathered_peak, "grad_staging": sampler.staging_peak,
            "heap_peak": sampler.heap_peak, "comm_buffers": sampler.pool_peak}
