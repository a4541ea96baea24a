"""``deepspeed.module_inject.tp_shard``: how DeepSpeed splits a dimension (heads, features) over a group.

DeepSpeed's AutoTP injection is not served (``"tensor_parallel": {"autotp_size": t}`` replaces it), but its
split rule is a pure function that Ulysses code and DeepSpeed's tests call to know which heads a rank holds:
with a key/value head count set (``set_num_kv_heads``) and dividing ``total_size``, whole heads are dealt out,
the first ``num_kv_heads % size`` ranks taking one more; otherwise ``total_size`` is split in grains of
``tp_grain_size`` the same way, the last rank taking the remainder. Same module-level settings and
signatures as DeepSpeed's.
"""

from __future__ import annotations

from typing import Any

import zerodist.comm as comm

num_kv_heads: int | None = None
num_attention_heads: int | None = None
n_embd: int | None = None
tp_grain_size = 1

_LAST_LINEAR = ("lm_head", "embed_out")
_MOE_MLP = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def set_num_kv_heads(num: int | None) -> None:
    global num_kv_heads
    num_kv_heads = num


def set_num_attention_heads(num: int | None) -> None:
    global num_attention_heads
    num_attention_heads = num


def set_n_embd(num: int | None) -> None:
    global n_embd
    n_embd = num


def set_tp_grain_size(num: int) -> None:
    global tp_grain_size
    tp_grain_size = num


def get_num_kv_heads() -> int | None:
    return num_kv_heads


def get_num_attention_heads() -> int | None:
    return num_attention_heads


def get_n_embd() -> int | None:
    return n_embd


def get_shard_size(total_size: int, mp_size: int, name: str | None = None, rank: int | None = None,
                   mp_group: Any = None, num_kv_heads: int | None = None) -> int:
    """The size of group rank ``rank``'s shard of ``total_size`` (``rank``: within the group; None: this
    process's rank in ``mp_group``, or in the world when the world is the group)."""
    heads = num_kv_heads if num_kv_heads is not None else globals()["num_kv_heads"]
    if rank is None:
        if mp_group is not None:
            rank = comm.get_rank(mp_group)
        elif comm.get_world_size() != mp_size:
            raise ValueError(f"get_shard_size requires a group-local rank or process group when mp_size ({mp_size}) "
                             f"differs from the distributed world size ({comm.get_world_size()}).")
        else:
            rank = comm.get_rank()
    by_heads = (heads is not None and total_size % heads == 0 and "mlp" not in str(name)
                and str(name) not in _LAST_LINEAR and not (name is not None and any(s in str(name) for s in _MOE_MLP)))
    if by_heads:
        assert heads is not None
        slices = heads // mp_size + (1 if rank < heads % mp_size else 0)
        return total_size * slices // heads
    if total_size >= tp_grain_size:
        grains, remainder = divmod(total_size, tp_grain_size)
        size = (grains // mp_size + (1 if rank < grains % mp_size else 0)) * tp_grain_size
        return size + (remainder if rank == mp_size - 1 else 0)
    return total_size // mp_size + (1 if rank < total_size % mp_size else 0)


def get_shard_size_list(total_size: int, mp_size: int, name: str | None = None,
                        num_kv_heads: int | None = None) -> list[int]:
    """Every group rank's shard size, in rank order; they sum to ``total_size``."""
    sizes = [get_shard_size(total_size, mp_size, name, rank, num_kv_heads=num_kv_heads) for rank in range(mp_size)]
    if sum(sizes) != total_size:
        raise ValueError(f"shard sizes {sizes} for '{name}' do not sum to the dimension size {total_size} with "
                         f"tp_size={mp_size}, tp_grain_size={tp_grain_size} and num_kv_heads={num_kv_heads}")
    return sizes
