"""The optimizer's view of a flat group: what this rank steps, and where those values live.

    master      mixed precision: fp32 copy of what this rank's optimizer steps (the full buffer
                with full optimizer state, this rank's shards otherwise)
    tensors     `tensors[i]` is what the optimizer steps for bucket i (the group's
                `optimizer_tensors`): a view into the parameters (fp32 training: the master
                weights *are* the parameters, no copy) or into `master`. Its gradient is bucket i's
                reduced gradient (GradStorage.reduced_grad).
    store       None, or the `SteppedStore` the values moved to ([Note: stepped values elsewhere]
                in stepped_store.py): then `tensors` and `master` are NaN broadcasts, same objects.

After each step (or load) the new values reach the parameters through the parameter storage's
`stepped_target(i)`: a copy in fp32 is none at all (the same memory), a cast under bf16/fp16.
"""

from __future__ import annotations

import torch

from zerodist.zero.flat_views import FlatViews
from zerodist.zero.param_storage import ParamStorage
from zerodist.zero.stepped_store import SteppedStore


class OptimizerView:
    """What the optimizer steps for one flat group on this rank."""

    store: SteppedStore | None = None

    def __init__(self, views: FlatViews, params: ParamStorage, master: torch.Tensor | None):
        self.views, self.params, self.master = views, params, master
        self.tensors = self._make_tensors()

    def _make_tensors(self) -> list[torch.Tensor]:
        views, params = self.views, self.params
        if self.master is None and params.param_shard is not None:
            return [views.shard(i, params.param_shard) for i in range(views.num_buckets)]
        if self.master is None:
            assert params.param_buffer is not None
            return [views.stepped(i, params.param_buffer) for i in range(views.num_buckets)]
        tensors, start = [], 0
        for i in range(views.num_buckets):
            numel = views.stepped_numel(i)
            tensors.append(self.master[start: start + numel])
            start += numel
        return tensors

    def owned_part(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's shard of bucket `index` within an optimizer-space tensor (one shaped like
        `tensors[index]`: the whole bucket with full optimizer state, the shard otherwise). The
        pieces it holds are listed, in order, by `layout.owned_slices(rank)` for that bucket."""
        if self.views.sharded_steps:
            return tensor
        span = self.views.layout.buckets[index]
        start = span.shard_offset(self.views.rank) - span.offset
        return tensor[start: start + span.shard_numel]

    def copy_master_to_params(self) -> None:
        """Mixed precision: the stepped master values, cast into the parameters."""
        if self.master is None or self.store is not None:  # held elsewhere: cast as each piece is stepped
            return
        for i, tensor in enumerate(self.tensors):
            self.params.stepped_target(i).copy_(tensor)

    def take_from_params(self) -> None:
        """After the full parameters were changed in place: the master (or the store) from them again."""
        buffer = self.params.param_buffer
        assert buffer is not None
        for i in range(self.views.num_buckets):
            stepped = self.views.stepped(i, buffer)
            if self.store is not None:
                self.store.write_values(self.tensors[i], 0, stepped)
            elif self.master is not None:
                self.tensors[i].copy_(stepped)

    def values(self, index: int) -> torch.Tensor:
        """`tensors[index]`'s values: the tensor itself, or a copy read from where they live."""
        tensor = self.tensors[index]
        if self.store is None:
            return tensor
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        self.store.read_values(tensor, 0, out)
        return out

    def write(self, index: int, values: torch.Tensor) -> None:
        """Set `tensors[index]`'s values (a load); held elsewhere, the parameters get their cast at
        once, otherwise with `copy_master_to_params()`."""
        tensor = self.tensors[index]
        if self.store is None:
            tensor.copy_(values)
            return
        self.store.write_values(tensor, 0, values)
        self.cast(index, 0, values)

    def cast(self, index: int, start: int, values: torch.Tensor) -> None:
        """Mixed precision: new master values of bucket `index` from element `start`, cast into the
        parameters (what `copy_master_to_params` does, one piece at a time)."""
        if self.master is None or self.params.shard_offloaded:  # fp32, or the shard is read from the master
            return
        self.params.stepped_target(index)[start: start + values.numel()].copy_(values)

    def read_into(self, index: int, out: torch.Tensor) -> None:
        """Bucket `index`'s stepped values from the store into `out`, cast to `out`'s dtype."""
        assert self.store is not None
        tensor = self.tensors[index]
        if out.dtype == tensor.dtype:
            self.store.read_values(tensor, 0, out)
        else:
            out.copy_(self.values(index))

    def release(self, store: SteppedStore) -> None:
        """The store holds the stepped values now: they leave memory, each a NaN broadcast to its shape."""
        self.store = store
        nan = torch.full((1,), float("nan"), dtype=torch.float32, device=self.params.device)
        for tensor in self.tensors:
            tensor.data = nan.to(tensor.dtype).expand(tensor.numel())
        if self.master is not None:
            self.master.data = nan.expand(self.master.numel())

    def master_bytes(self) -> int:
        return 0 if self.store is not None or self.master is None else self.master.numel() * self.master.element_size()
