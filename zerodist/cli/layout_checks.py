"""What `zerodist train` checks of the config against its ranks before it spawns them: the keys whose
validity depends on the layout (issue 37: each of these passed the pre-spawn checks and then failed
on every rank with a traceback). Config arithmetic only, the same rules and words as the engine's
own checks (zerodist/zero/hierarchy.py, zerodist/comm/nodes.py, zerodist/zero/canonical.py), which
stay as the guard for a loop of one's own:

- `zerodist.simulated_nodes` must divide the world;
- `zero_optimization.mics_shard_size` must divide the data-parallel degree, with no other axis;
- `zero_optimization.zero_hpz_partition_size` must divide the ranks parameters are sharded over;
- `zerodist.deterministic: layout_invariant` refuses what it cannot make bitwise.

Each raises a ValueError subclass naming the key, which the CLI prints as one line with exit code 2.
"""

from __future__ import annotations

from typing import Any

from zerodist.comm.errors import TopologyError


def check_layout_keys(config: Any, *, world_size: int, tensor: int, sequence: int, pipe: int, expert: int,
                      accumulation: int) -> None:
    """Raise, naming the key and the fix, where a layout-dependent key cannot apply to these degrees
    (`config`: a validated `zerodist.config.Config`)."""
    nodes = config.zerodist.simulated_nodes
    if nodes is not None and world_size % nodes:
        raise TopologyError(f"'zerodist.simulated_nodes' ({nodes}) does not divide the world of {world_size} ranks; "
                            f"set it to a divisor of {world_size}")
    data = world_size // (tensor * sequence * pipe)
    others = {axis: d for axis, d in (("tensor", tensor), ("sequence", sequence), ("pipe", pipe), ("expert", expert))
              if d > 1}
    zero = config.zero_optimization
    shard = _mics_shard(zero.mics_shard_size, data * sequence, others)
    if zero.stage == 3 and zero.zero_hpz_partition_size > 1:
        k = zero.zero_hpz_partition_size
        if others:
            raise TopologyError(f"'zero_optimization.zero_hpz_partition_size' ({k}) builds its groups over "
                                f"data-parallel ranks only; it cannot be combined with {_listed(others)}: remove "
                                "zero_hpz_partition_size or those degrees")
        sharded = shard or data
        if sharded > 1 and sharded % k:
            raise TopologyError(f"'zero_optimization.zero_hpz_partition_size' ({k}) must divide the {sharded} ranks "
                                "parameters are sharded over (the data-parallel degree, or mics_shard_size); choose "
                                f"one of {_divisors(sharded)}")
    if config.zerodist.deterministic == "layout_invariant":
        from zerodist.engine.initialize import _reduction_keys  # the engine's own list of the keys it refuses
        from zerodist.zero.canonical import check_layout

        check_layout(data_degree=data, accumulation=accumulation, stage=zero.stage, pipe=pipe, sequence=sequence,
                     expert=expert, fp16=config.fp16.enabled,
                     tensor_sequence_parallel=config.zerodist.tensor_parallel.sequence_parallel,
                     reduction_keys=_reduction_keys(config, shard is not None))


def _mics_shard(size: int, data: int, others: dict[str, int]) -> int | None:
    """MiCS's shard group size on these degrees, or None for plain ZeRO (hierarchy.shard_size_for's rules)."""
    if size in (-1, data):
        return None
    if others:
        raise TopologyError(f"'zero_optimization.mics_shard_size' ({size}) shards over data-parallel ranks only; it "
                            f"cannot be combined with {_listed(others)}: remove mics_shard_size or those degrees")
    if size < 1 or data % size:
        raise TopologyError(f"'zero_optimization.mics_shard_size' ({size}) must divide the data-parallel degree "
                            f"({data}); choose one of {_divisors(data)}")
    return size


def _listed(degrees: dict[str, int]) -> str:
    return ", ".join(f"{axis} ({degree})" for axis, degree in degrees.items())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
