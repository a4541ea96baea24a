"""The layout-invariant mode (issue 35, docs/determinism.md): parameters, optimizer state and
per-step losses torch.equal to one process x 8 micro-batches, for data 2 x 4 and 4 x 2 at every
ZeRO stage, with nvme offload, on the demo GPT and a Hugging Face Llama; through zerodist's loader;
across a checkpoint that changes the layout. Refusals by name. The arithmetic itself (the binary
counter reproduced by both data layouts) is checked in one process."""

from __future__ import annotations

import functools

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.harness import run_distributed
from tests.zero.layout_invariant_helpers import MICRO_ROWS, MICROS, assert_bitwise, mode_config, train_in_mode
from zerodist.data import LayoutInvariantSampler
from zerodist.models import GPT, gpt_config
from zerodist.zero.canonical import CanonicalSum, LayoutInvariantError, check_layout, micro_batch_index

STEPS = 10


BF16 = {"bf16": {"enabled": True}}


@functools.cache
def reference(kind: str = "gpt", steps: int = STEPS, bf16: bool = False) -> dict:
    """One process, accumulation 8 (ZeRO 0): what every layout must equal, bit for bit."""
    result = run_distributed(train_in_mode, 1, 0, steps, kind, timeout=240, **(BF16 if bf16 else {}))[0]
    assert result["clipped_steps"] > 0, "the test needs gradient clipping active"
    return result


# ---------------------------------------------------------------- the arithmetic, one process
def _tree(leaves: list[torch.Tensor]) -> torch.Tensor:
    if len(leaves) == 1:
        return leaves[0].clone()
    half = len(leaves) // 2
    return _tree(leaves[:half]) + _tree(leaves[half:])


def _counter(leaves: list[torch.Tensor]) -> torch.Tensor:
    total = CanonicalSum()
    for leaf in leaves:
        total.push(leaf.clone())
    result = total.fold()
    assert result is not None
    return result


def _layout_sum(leaves: list[torch.Tensor], data: int, shard_gradients: bool) -> torch.Tensor:
    """What `data` ranks compute: contiguous (local counter, then the ranks' sums in rank order) or
    interleaved (each micro-step's pieces in rank order, then the micro-steps' sums)."""
    accumulation = len(leaves) // data
    index = functools.partial(micro_batch_index, data_degree=data, accumulation=accumulation,
                              shard_gradients=shard_gradients)
    if shard_gradients:
        return _counter([_counter([leaves[index(r, j)] for r in range(data)]) for j in range(accumulation)])
    return _counter([_counter([leaves[index(r, j)] for j in range(accumulation)]) for r in range(data)])


@pytest.mark.unit
@pytest.mark.parametrize("micros", [8, 16])
def test_the_counter_is_the_pairwise_tree_and_every_layout_reproduces_it(micros):
    g = torch.Generator().manual_seed(3)
    leaves = [torch.randn(4096, generator=g) * 10.0 ** int(torch.randint(-3, 3, (), generator=g)) for _ in range(micros)]
    expected = _tree(leaves)
    assert torch.equal(_counter(leaves), expected)
    assert not torch.equal(sum(leaves, torch.zeros(4096)), expected)  # the order matters at all
    data = 1
    while data <= micros:
        for shard in (False, True):
            assert torch.equal(_layout_sum(leaves, data, shard), expected), (data, shard)
        data *= 2


@pytest.mark.unit
def test_beyond_powers_of_two_the_counter_holds_where_docs_say():
    """K = 12: contiguous holds for any data degree when the accumulation is a power of two (3 x 4),
    interleaved for any accumulation when the data degree is (4 x 3); not the other way round."""
    g = torch.Generator().manual_seed(4)
    leaves = [torch.randn(2048, generator=g) for _ in range(12)]
    expected = _counter(leaves)
    assert torch.equal(_layout_sum(leaves, 3, shard_gradients=False), expected)
    assert torch.equal(_layout_sum(leaves, 4, shard_gradients=True), expected)
    assert not torch.equal(_layout_sum(leaves, 4, shard_gradients=False), expected)


@pytest.mark.unit
@pytest.mark.parametrize("shard_gradients", [False, True])
def test_the_sampler_puts_the_same_samples_in_each_micro_batch_for_every_layout(shard_gradients):
    def micro_batches(data: int) -> dict[tuple[int, int], list[int]]:
        """(global step, micro-batch k) -> its samples, over every rank of a data degree."""
        accumulation = MICROS // data
        found = {}
        for rank in range(data):
            sampler = LayoutInvariantSampler(100, micro_batch_size=MICRO_ROWS, accumulation=accumulation,
                                             num_replicas=data, rank=rank, shard_gradients=shard_gradients, seed=5)
            sampler.set_epoch(2)
            order = list(sampler)
            assert len(order) == len(sampler) == 6 * accumulation * MICRO_ROWS
            for position in range(0, len(order), MICRO_ROWS):
                step, j = divmod(position // MICRO_ROWS, accumulation)
                k = micro_batch_index(rank, j, data, accumulation, shard_gradients)
                found[(step, k)] = order[position: position + MICRO_ROWS]
        return found

    one = micro_batches(1)
    assert len(one) == 6 * MICROS
    assert micro_batches(2) == one and micro_batches(4) == one and micro_batches(8) == one


@pytest.mark.unit
def test_layouts_the_mode_cannot_honour_are_refused_by_name():
    with pytest.raises(LayoutInvariantError, match=r"gradient_accumulation_steps 3 is not a power of two"):
        check_layout(data_degree=2, accumulation=3, stage=1, pipe=2, sequence=1, expert=1, fp16=False)
    check_layout(data_degree=2, accumulation=4, stage=1, pipe=2, sequence=1, expert=1, fp16=False)  # a pipeline: allowed
    with pytest.raises(LayoutInvariantError, match="data-parallel degree 3.*docs/determinism.md"):
        check_layout(data_degree=3, accumulation=1, stage=0, pipe=1, sequence=1, expert=1, fp16=False)
    with pytest.raises(LayoutInvariantError, match=r"sequence parallelism \(degree 2\).*expert-parallel degree 3.*fp16"):
        check_layout(data_degree=1, accumulation=1, stage=0, pipe=1, sequence=2, expert=3, fp16=True)
    with pytest.raises(LayoutInvariantError, match="tensor_parallel.sequence_parallel"):
        check_layout(data_degree=2, accumulation=1, stage=0, pipe=1, sequence=1, expert=1, fp16=False,
                     tensor_sequence_parallel=True)
    with pytest.raises(LayoutInvariantError, match="mics_shard_size, zero_optimization.zero_quantized_gradients change"):
        check_layout(data_degree=4, accumulation=1, stage=3, pipe=1, sequence=1, expert=1, fp16=False,
                     reduction_keys=("zero_optimization.mics_shard_size", "zero_optimization.zero_quantized_gradients"))
    check_layout(data_degree=4, accumulation=2, stage=3, pipe=1, sequence=1, expert=1, fp16=False)


# ---------------------------------------------------------------- real runs against one process
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_stage_and_data_layout_is_bitwise_one_process(stage, world_size):
    results = run_distributed(train_in_mode, world_size, stage, STEPS, timeout=240)
    for result in results:
        assert_bitwise(result, reference())


@pytest.mark.slow
def test_reduce_scatter_off_and_nvme_offload_are_bitwise_one_process(tmp_path):
    for overrides in ({"zero_optimization": {"reduce_scatter": False}},
                      {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}):
        for result in run_distributed(train_in_mode, 2, 2, STEPS, timeout=240, **overrides):
            assert_bitwise(result, reference())


@pytest.mark.slow
@pytest.mark.parametrize("stage,world_size", [(0, 2), (3, 2), (2, 4)])
def test_bf16_is_bitwise_one_process(stage, world_size):
    """bf16 parameters and gradients (reduced in bf16 by the same tree), fp32 master and AdamW state."""
    for result in run_distributed(train_in_mode, world_size, stage, STEPS, timeout=240, **BF16):
        assert_bitwise(result, reference(bf16=True))


@pytest.mark.slow
@pytest.mark.parametrize("stage,world_size", [(0, 2), (3, 2), (0, 4), (3, 4)])
def test_hugging_face_llama_is_bitwise_one_process(stage, world_size):
    """Data 2 x 4 and 4 x 2 at ZeRO 0 and 3 (the pipeline row: tests/zero/test_layout_invariant_pipe.py)."""
    for result in run_distributed(train_in_mode, world_size, stage, STEPS, "llama", timeout=300):
        assert_bitwise(result, reference("llama"))


@pytest.mark.slow
def test_hugging_face_llama_in_bf16_is_bitwise_one_process():
    for result in run_distributed(train_in_mode, 2, 3, STEPS, "llama", timeout=300, **BF16):
        assert_bitwise(result, reference("llama", bf16=True))


@pytest.mark.slow
def test_hugging_face_llama_with_nvme_offload_at_zero_2_is_bitwise_one_process(tmp_path):
    nvme = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    for result in run_distributed(train_in_mode, 2, 2, STEPS, "llama", timeout=300, **nvme):
        assert_bitwise(result, reference("llama"))


@pytest.mark.slow
def test_a_checkpoint_at_data_4_resumes_at_data_2_x_accumulation_4_bitwise(tmp_path):
    """Saved at data 4 x accumulation 2 (ZeRO 3) after 5 steps, resumed at data 2 x accumulation 4
    (ZeRO 1): the next 10 steps (parameters, AdamW state, losses) equal the uninterrupted 15-step run."""
    before, after = 5, STEPS
    expected = reference("gpt", before + after)
    for result in run_distributed(train_in_mode, 4, 3, before, save=str(tmp_path), timeout=240):
        assert torch.equal(result["losses"], expected["losses"][:before])
    for result in run_distributed(train_in_mode, 2, 1, after, first_step=before, load=str(tmp_path), timeout=240):
        assert_bitwise({**result, "losses": torch.cat([expected["losses"][:before], result["losses"]])}, expected)


def _train_from_loader(stage: int, steps: int) -> dict:
    """initialize(training_data=...) and train_batch() with no iterator: the mode's sampler deals."""
    torch.manual_seed(0)
    cfg = gpt_config("tiny")
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, cfg.vocab_size, (3 * MICROS * MICRO_ROWS, cfg.seq_len + 1), generator=g)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    config = mode_config(stage, MICROS // comm.get_world_size())
    engine = zerodist.initialize(model=GPT(cfg), config=config, training_data=data)[0]
    losses = torch.stack([engine.train_batch() for _ in range(steps)])
    return {"params": engine.zero_state.logical_state_dict(), "losses": losses}


@pytest.mark.parametrize("stage", [1, 3])
def test_zerodists_loader_deals_the_same_micro_batches_in_every_layout(stage):
    expected = run_distributed(_train_from_loader, 1, 0, 4, timeout=240)[0]
    for result in run_distributed(_train_from_loader, 2, stage, 4, timeout=240):
        assert torch.equal(result["losses"], expected["losses"])
        assert all(torch.equal(result["params"][k], v) for k, v in expected["params"].items())


def _refused_everywhere(accumulation: int, zero: dict) -> str:
    config = mode_config(3 if zero else 1, accumulation)
    config["zero_optimization"].update(zero)
    try:
        zerodist.initialize(model=GPT(gpt_config("tiny")), config=config)
    except LayoutInvariantError as error:
        return str(error)
    return "initialized"


def test_an_unsupported_layout_is_refused_on_every_rank_before_any_collective():
    for message in run_distributed(_refused_everywhere, 2, 3, {}, timeout=120):
        assert "gradient_accumulation_steps 3 is not a power of two" in message
    # MiCS with shards of one rank: its replica all-reduce would add across every data rank in the
    # backend's order; with shards of the data degree it is plain ZeRO, which the mode honours
    for message in run_distributed(_refused_everywhere, 2, 2, {"mics_shard_size": 1}, timeout=120):
        assert "zero_optimization.mics_shard_size change how gradients are reduced" in message
    assert run_distributed(_refused_everywhere, 2, 2, {"mics_shard_size": 2}, timeout=120) == ["initialized"] * 2


def _whole(state: dict) -> torch.Tensor:
    return torch.cat([state[k].double().reshape(-1) for k in sorted(state)])


@pytest.mark.slow
def test_tensor_parallel_is_bitwise_across_data_layouts_and_close_to_one_process():
    """Tensor degree 2: data 1 x 8 (ZeRO 0) and data 2 x 4 (ZeRO 3) bitwise equal; against one
    process the row-parallel matmuls add in another order (docs/determinism.md): the residual,
    which depends on the CPU's matmul kernels (9.4e-7 on one machine, 1.13e-6 on another), so the
    bound is 2e-6: ten AdamW steps over rounding of 1e-7, not a layout's error (those are 1e-5 and up)."""
    tensor = {"zerodist": {"tensor_parallel": {"size": 2}}}
    one = run_distributed(train_in_mode, 2, 0, STEPS, timeout=300, **tensor)[0]
    for result in run_distributed(train_in_mode, 4, 3, STEPS, timeout=300, **tensor):
        assert torch.equal(result["losses"], one["losses"])
        assert all(torch.equal(result["params"][k], v) for k, v in one["params"].items())
    expected = reference()
    residual = float((_whole(one["params"]) - _whole(expected["params"])).norm() / _whole(expected["params"]).norm())
    assert 0 < residual <= 2e-6, residual
    assert float((one["losses"] - expected["losses"]).abs().max()) <= 1e-6


def _exact_squares_of(values: list[float]) -> float:
    from zerodist.zero.canonical import exact_squares

    tensor = torch.tensor(values, dtype=torch.float32)
    mine = tensor.chunk(comm.get_world_size())[comm.get_rank()]
    return exact_squares([mine[:1], mine[1:]], None, torch.device("cpu"))


def test_the_exact_norm_is_split_independent_and_skips_a_nan_on_one_rank():
    g = torch.Generator().manual_seed(8)
    values = (torch.randn(64, generator=g) * 10.0 ** torch.randint(-6, 6, (64,), generator=g).double()).tolist()
    one, two = run_distributed(_exact_squares_of, 1, values)[0], run_distributed(_exact_squares_of, 2, values)
    assert two == [one, one] and abs(one - sum(v * v for v in torch.tensor(values).tolist())) <= 64 * 2.0**-41 * one
    assert run_distributed(_exact_squares_of, 2, [1.0] * 63 + [float("nan")]) == [float("inf")] * 2
