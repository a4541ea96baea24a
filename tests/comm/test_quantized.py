"""Quantized collectives (zerodist/comm/quantized.py) on real ranks: qwZ all-gather and qgZ
reduce-scatter (one hop, and hierarchical on 4 ranks as 2 nodes x 2), against the exact
collectives' results within the quantization bound, bitwise against a one-process simulation
of the same algorithm, and the tracer's bytes against the formulas."""

from __future__ import annotations

import pytest
import torch

import zerodist.comm as comm
from zerodist.comm.quantize import dequantize, quantization_error, quantize_blockwise, quantized_nbytes
from zerodist.comm.quantized import (
    all_gather_nbytes,
    measure_quantization_error,
    quantized_all_gather,
    quantized_all_gather_start,
    quantized_reduce_scatter,
    quantized_reduce_scatter_start,
    reduce_scatter_nbytes,
    reduce_scatter_shard_index,
)
from tests.harness import distributed_test, run_distributed

BLOCK = 16


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s input, reproducible on every rank; magnitudes vary by chunk so scales differ."""
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(numel, generator=g) * torch.linspace(0.1, 4.0, numel)).to(dtype)


def _round_trip(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x through quantize + dequantize, in fp32."""
    return dequantize(quantize_blockwise(x, bits, BLOCK), torch.float32)


def _half_scales(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Per element, half its block's scale: the round-trip error bound of `x` quantized alone."""
    q = quantize_blockwise(x, bits, BLOCK)
    return (q.scales / 2).repeat_interleave(BLOCK)[:x.numel()]


def _sum_in_order(rows: list[torch.Tensor]) -> torch.Tensor:
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total


# ---------------------------------------------------------------- qwZ: all-gather

@distributed_test(world_size=[2, 4])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_all_gather_matches_exact_gather(world_size, bits, dtype):
    rank, shard_numel = comm.get_rank(), 37  # not a multiple of the block
    shards = [_input(r, shard_numel, dtype) for r in range(world_size)]
    with comm.trace() as t:
        full = quantized_all_gather(shards[rank], bits=bits, block=BLOCK)
    assert full.dtype == dtype and full.shape == (world_size * shard_numel,)
    # bitwise what every rank computes alone from every shard's quantized form: the same bits everywhere,
    # the owner's own shard included
    expected = torch.cat([_round_trip(s, bits) for s in shards]).to(dtype)
    assert torch.equal(full, expected)
    exact = torch.cat(shards).float()
    bound = torch.cat([_half_scales(s, bits) for s in shards])
    assert torch.all((full.float() - exact).abs() <= bound * (1 + 1e-5) + _dtype_ulp(dtype, exact))
    assert t.count() == 1 and t.total_bytes("all_gather") == all_gather_nbytes(shard_numel, world_size, bits, BLOCK)
    assert t.total_bytes() == world_size * quantized_nbytes(shard_numel, bits, BLOCK)

    out = torch.full((world_size * shard_numel,), float("nan"), dtype=torch.float32)
    assert quantized_all_gather(shards[rank], None, bits, BLOCK, out=out) is out
    assert torch.equal(out, torch.cat([_round_trip(s, bits) for s in shards]))


def _dtype_ulp(dtype: torch.dtype, exact: torch.Tensor) -> torch.Tensor:
    """The rounding of the final cast to `dtype` (0 for fp32)."""
    return exact.abs() * (torch.finfo(dtype).eps if dtype != torch.float32 else 4 * torch.finfo(torch.float32).eps)


# ---------------------------------------------------------------- qgZ: one hop

@distributed_test(world_size=[2, 4])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_reduce_scatter_matches_exact_sum(world_size, bits, dtype):
    rank, shard_numel = comm.get_rank(), 45
    numel = world_size * shard_numel
    inputs = [_input(r, numel, dtype) for r in range(world_size)]
    with comm.trace() as t:
        mine = quantized_reduce_scatter(inputs[rank], bits=bits, block=BLOCK)
    assert mine.dtype == dtype and mine.shape == (shard_numel,)
    assert reduce_scatter_shard_index() == rank
    lo, hi = rank * shard_numel, (rank + 1) * shard_numel
    # the contract: reduce_scatter's slice; compared with the exact collective on the same inputs
    exact = torch.empty(shard_numel, dtype=torch.float32)
    comm.reduce_scatter(exact, inputs[rank].float())
    chunks = [x[lo:hi] for x in inputs]
    simulated = _sum_in_order([_round_trip(c, bits) for c in chunks]).to(dtype)
    assert torch.equal(mine, simulated)
    bound = _sum_in_order([_half_scales(c, bits) for c in chunks])
    assert torch.all((mine.float() - exact).abs() <= bound * (1 + 1e-5) + _dtype_ulp(dtype, exact) + 1e-6)
    hop1, hop2 = reduce_scatter_nbytes(numel, world_size, bits, BLOCK)
    assert hop2 == 0 and t.count() == 1 and t.total_bytes("all_to_all") == hop1
    assert hop1 == world_size * quantized_nbytes(shard_numel, bits, BLOCK)


# ---------------------------------------------------------------- qgZ: hierarchical, 2 nodes x 2 ranks

def _node_groups() -> tuple[object, object]:
    """Nodes {0, 1} and {2, 3}: this rank's intra-node group and its group across nodes."""
    rank = comm.get_rank()
    intra = [comm.new_group(r) for r in ([0, 1], [2, 3])]  # every rank creates every group, same order
    inter = [comm.new_group(r) for r in ([0, 2], [1, 3])]
    return intra[rank // 2], inter[rank % 2]


def _simulate_hierarchical(inputs: list[torch.Tensor], shard_numel: int, bits: int, node: int, local: int,
                           nodes: int = 2, per_node: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """One process's replay of DeepSpeed's hierarchical qgZ for destination (node, local): the result
    (fp32) and its error bound: hop 1's round-trip bounds plus hop 2's bound on each node's partial sum."""
    def chunk(x: torch.Tensor, n: int) -> torch.Tensor:
        d = n * per_node + local
        return x[d * shard_numel:(d + 1) * shard_numel]

    partials, bound = [], torch.zeros(shard_numel)
    for n in range(nodes):  # node n's partial sum of chunk (node, local), summed on rank (n, local)
        senders = [inputs[n * per_node + i] for i in range(per_node)]
        partial = _sum_in_order([_round_trip(chunk(x, node), bits) for x in senders])
        bound += _sum_in_order([_half_scales(chunk(x, node), bits) for x in senders])
        partials.append(_round_trip(partial, bits))
        bound += _half_scales(partial, bits)
    return _sum_in_order(partials), bound


@distributed_test(world_size=4)
@pytest.mark.parametrize("bits", [8, 4])
def test_hierarchical_quantized_reduce_scatter(bits):
    rank, shard_numel, world = comm.get_rank(), 40, 4
    intra, inter = _node_groups()
    numel = world * shard_numel
    inputs = [_input(r, numel, torch.float32) for r in range(world)]
    with comm.trace() as t:
        mine = quantized_reduce_scatter(inputs[rank], intra, bits, BLOCK, inter_group=inter)
    assert reduce_scatter_shard_index(intra, inter) == rank  # node-contiguous ranks: the global rank
    exact = torch.empty(shard_numel)
    comm.reduce_scatter(exact, inputs[rank].clone())
    simulated, bound = _simulate_hierarchical(inputs, shard_numel, bits, node=rank // 2, local=rank % 2)
    assert torch.equal(mine, simulated)
    assert torch.all((mine - exact).abs() <= bound * (1 + 1e-5) + 1e-6)
    hop1, hop2 = reduce_scatter_nbytes(numel, 2, bits, BLOCK, inter_size=2)
    assert [(r.op, r.group_size, r.num_bytes) for r in t.records] == [("all_to_all", 2, hop1), ("all_to_all", 2, hop2)]
    assert hop1 == 4 * quantized_nbytes(shard_numel, bits, BLOCK) and hop2 == 2 * quantized_nbytes(shard_numel, bits, BLOCK)


# ---------------------------------------------------------------- bad input: refused on every rank, no hang

def _refuses_bad_input() -> str:
    rank = comm.get_rank()
    messages = []
    for call in (lambda: quantized_reduce_scatter(torch.ones(5)),
                 lambda: quantized_reduce_scatter(torch.ones(4), bits=3),
                 lambda: quantized_all_gather(torch.ones(4, dtype=torch.int32)),
                 lambda: quantized_all_gather(torch.ones(4), out=torch.empty(3))):
        try:
            call()
        except (ValueError, TypeError) as error:
            messages.append(str(error))
    # the ranks are still in step: a collective after the refusals pairs up
    total = torch.tensor([float(rank)])
    comm.all_reduce(total)
    assert total.item() == 1.0
    return " | ".join(messages)


def test_bad_input_is_refused_on_every_rank_before_any_collective():
    messages = run_distributed(_refuses_bad_input, 2, timeout=60)
    assert messages[0] == messages[1]
    for fragment in ("not a multiple of the 2 ranks", "pad it to a multiple of 2", "bits must be one of",
                     "must be floating point", "out has 3 elements"):
        assert fragment in messages[0]


# ---------------------------------------------------------------- async forms, the error meter, membership

@distributed_test(world_size=4)
def test_start_forms_overlap_and_give_the_same_bits():
    rank, world = comm.get_rank(), 4
    intra, inter = _node_groups()
    shard = _input(rank, 33, torch.float32)
    flat = _input(rank, world * 24, torch.bfloat16)
    # several in flight at once, waited in issue order (as ZeRO's buckets are)
    gathers = [quantized_all_gather_start(shard * (i + 1), bits=8, block=BLOCK) for i in range(2)]
    scatters = [quantized_reduce_scatter_start(flat, intra, 4, BLOCK, inter_group=inter),
                quantized_reduce_scatter_start(flat, None, 8, BLOCK)]
    results = [h.wait() for h in gathers + scatters]
    assert all(h.is_completed() for h in gathers + scatters)
    assert gathers[0].wait() is results[0]  # waiting twice is safe
    assert torch.equal(results[0], quantized_all_gather(shard, bits=8, block=BLOCK))
    assert torch.equal(results[1], quantized_all_gather(shard * 2, bits=8, block=BLOCK))
    assert torch.equal(results[2], quantized_reduce_scatter(flat, intra, 4, BLOCK, inter_group=inter))
    assert torch.equal(results[3], quantized_reduce_scatter(flat, None, 8, BLOCK))


@distributed_test(world_size=2)
@pytest.mark.parametrize("bits", [8, 4])
def test_error_meter_measures_what_this_rank_quantized(bits):
    rank = comm.get_rank()
    shard, flat = _input(rank, 50, torch.float32), _input(rank + 7, 64, torch.float32)
    with measure_quantization_error() as meter:
        quantized_all_gather(shard, bits=bits, block=BLOCK)
        quantized_reduce_scatter(flat, bits=bits, block=BLOCK)
    expected = quantization_error(shard, _round_trip(shard, bits))
    assert meter.numel("all_gather") == 50 and meter.numel("reduce_scatter") == 64 and meter.numel() == 114
    assert meter.error("all_gather").rel_l2 == pytest.approx(expected.rel_l2, rel=1e-9)
    assert meter.error("all_gather").max_abs == pytest.approx(expected.max_abs, rel=1e-9)
    halves = [flat[:32], flat[32:]]  # one chunk per destination, quantized on its own
    both = torch.cat([_round_trip(h, bits) for h in halves])
    assert meter.error("reduce_scatter").rel_l2 == pytest.approx(quantization_error(flat, both).rel_l2, rel=1e-9)
    assert 0 < meter.error().rel_l2 < (0.01 if bits == 8 else 0.15)
    quantized_all_gather(shard, bits=bits, block=BLOCK)  # outside the block: not measured
    assert meter.numel() == 114


def _refuses_foreign_group() -> str:
    other = comm.new_group([1])  # rank 0 is not a member
    if comm.get_rank() == 1:
        return ""
    try:
        quantized_reduce_scatter(torch.ones(4), other)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_a_group_this_rank_is_not_in_is_refused():
    messages = run_distributed(_refuses_foreign_group, 2, timeout=60)
    assert "is not a member of the group" in messages[0]


@distributed_test(world_size=2)
@pytest.mark.parametrize("bits", [8, 4])
def test_an_overflow_on_one_rank_reaches_the_owner_of_its_shard(bits):
    rank = comm.get_rank()
    flat = _input(rank, 64, torch.float32)
    if rank == 1:
        flat[3] = float("inf")  # in rank 0's shard, block 0
    mine = quantized_reduce_scatter(flat, bits=bits, block=BLOCK)
    if rank == 0:
        assert not torch.isfinite(mine[:BLOCK]).any() and torch.isfinite(mine[BLOCK:]).all()
    else:
        assert torch.isfinite(mine).all()


@distributed_test(world_size=2)
def test_degenerate_hierarchies_one_node_or_one_rank_per_node():
    """inter_group of one rank (one node: the same as no hierarchy but for the re-quantization) and
    group of one rank (every rank its own node): the shard contract still holds."""
    rank, shard_numel = comm.get_rank(), 40
    singletons = [comm.new_group([r]) for r in range(2)]
    mine_alone = singletons[rank]
    inputs = [_input(r, 2 * shard_numel, torch.float32) for r in range(2)]
    exact = torch.empty(shard_numel)
    comm.reduce_scatter(exact, inputs[rank].clone())
    chunks = [x[rank * shard_numel:(rank + 1) * shard_numel] for x in inputs]
    one_hop = quantized_reduce_scatter(inputs[rank], None, 8, BLOCK)

    one_node = quantized_reduce_scatter(inputs[rank], None, 8, BLOCK, inter_group=mine_alone)
    assert reduce_scatter_shard_index(None, mine_alone) == rank
    assert torch.equal(one_node, _round_trip(one_hop, 8))  # hop 2 re-quantizes the one partial sum

    own_nodes = quantized_reduce_scatter(inputs[rank], mine_alone, 8, BLOCK)
    assert torch.equal(own_nodes, _round_trip(inputs[rank], 8))  # a group of one: no reduction
    every_rank_a_node = quantized_reduce_scatter(inputs[rank], mine_alone, 8, BLOCK, inter_group=comm.get_world_group())
    assert reduce_scatter_shard_index(mine_alone, comm.get_world_group()) == rank
    simulated = _sum_in_order([_round_trip(_round_trip(c, 8), 8) for c in chunks])
    assert torch.equal(every_rank_a_node, simulated)
    assert torch.all((every_rank_a_node - exact).abs() <= 1e-2 * exact.abs().max())
