"""The past-one-machine lines of `zerodist train`'s summary (`--nnodes-sim K`, or a real multi-node
launch): bus bytes per step per link class (intra / inter node, [Note: link classes] in
zerodist/comm/nodes.py) against docs/design/zero.md's formulas (zerodist/zero/link_bytes.py), and
with ZeRO++'s quantized collectives the quantization error of the last step."""

from __future__ import annotations

from typing import Any

from zerodist.utils import format_bytes
from zerodist.zero.link_bytes import step_link_bytes


def link_lines(engine: Any, last_step: Any, meter: Any | None) -> list[str]:
    """Rank 0's lines: the last step's bus bytes by link class (`last_step`: its trace; a step in the
    steady state: it issues the next step's early gathers as the previous step issued its own), the
    formula's, and the last step's quantization error (`meter`; rank 0's own contribution:
    zerodist/comm/quantized.py)."""
    topology, zero = engine.topology, engine.config.zero_optimization
    measured = last_step.bus_bytes_by_link()
    formula = step_link_bytes(engine)
    modes = [name for name, on in (("MiCS shard groups of %d" % zero.mics_shard_size, zero.mics_shard_size > 1),
                                   ("hpZ %d" % zero.zero_hpz_partition_size, zero.zero_hpz_partition_size > 1),
                                   ("qwZ int8", zero.zero_quantized_weights),
                                   ("qgZ int4", zero.zero_quantized_gradients)) if on]
    lines = [f"links: {topology.num_nodes} node(s) of {topology.ranks_per_node} rank(s)"
             f"{' (simulated)' if engine.config.zerodist.simulated_nodes else ''}; "
             f"{', '.join(modes) if modes else 'plain ZeRO'}; bus bytes of the last step on rank 0:"]
    for link in ("intra", "inter"):
        got, want = measured[link], formula[link]
        ratio = f"{got / want:.3f}x" if want else ("-" if not got else "n/a")
        lines.append(f"  {link}-node: {format_bytes(got)} measured, {format_bytes(want)} by docs/design/zero.md's "
                     f"formula ({ratio}; the rest is the loss's and the norm's scalar all-reduces)")
    if meter is not None:
        for op, name in (("all_gather", "qwZ weights"), ("reduce_scatter", "qgZ gradients")):
            if meter.numel(op):
                error = meter.error(op)
                lines.append(f"  last step's quantization error, {name} (rank 0's): relative L2 "
                             f"{error.rel_l2:.2e}, max abs {error.max_abs:.2e}")
    return lines
