"""What `zerodist train` checks of the config against its ranks before it spawns them: the keys whose
validity depends on the layout (issue 37: each of these passed the pre-spawn checks and then failed
on every rank with a traceback). Config arithmetic only, the same rules and words as the engine's
own checks (zerodist/zero/hierarchy.py, zerodist/comm/nodes.py, zerodist/zero/canonical.py), which
stay as the guard for a loop of one's own:

- `zerodist.simulated_nodes` must divide the world;
- `zero_optimization.mics_shard_size` must divide the ranks ZeRO shards over, with no expert axis
  (`zerodist.hsdp`'s shard x replicate degrees must be those ranks);
- `zero_optimization.zero_hpz_partition_size` must divide the ranks parameters are sharded over,
  with neither an expert axis nor a pipeline;
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
    from zerodist.zero.hierarchy import HierarchySettings, check_hpz_on, shard_size_on  # the engine's own rules

    settings = HierarchySettings.from_config(config)
    shard = shard_size_on(settings, dense=data * sequence, expert=expert)
    if settings.hpz_size > 1:
        check_hpz_on(settings.hpz_size, sharded=shard or data * sequence, expert=expert, pipe=pipe)
    zero = config.zero_optimization
    if config.zerodist.deterministic == "layout_invariant":
        from zerodist.engine.initialize import _reduction_keys  # the engine's own list of the keys it refuses
        from zerodist.zero.canonical import check_layout

        check_layout(data_degree=data, accumulation=accumulation, stage=zero.stage, pipe=pipe, sequence=sequence,
                     expert=expert, fp16=config.fp16.enabled,
                     tensor_sequence_parallel=config.zerodist.tensor_parallel.sequence_parallel,
                     reduction_keys=_reduction_keys(config, shard is not None))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
