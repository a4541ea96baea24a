"""`zerodist estimate`: the per-rank memory table of docs/design/zero.md, exactly, with shard padding."""

from __future__ import annotations

import pytest

from zerodist.cli.main import main
from zerodist.debug.estimate import (
    activation_bytes,
    estimate_all_stages,
    estimate_memory,
    formula,
    parse_count,
    shard_numel,
)

pytestmark = pytest.mark.unit


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# docs/design/zero.md, "Model state per rank": (replicated bytes per param, sharded bytes per param) for each stage.
DESIGN_TABLE = {
    "bf16": {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)},
    "fp32": {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)},
}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_follow_design_table(dtype, stage):
    replicated, sharded = DESIGN_TABLE["fp32" if dtype == "fp32" else "bf16"][stage]
    for num_params in [1, 7, 1000, 124_439_808, 7_000_000_001]:
        for world_size in [1, 2, 3, 8, 1000]:
            est = estimate_memory(num_params, world_size=world_size, stage=stage, dtype=dtype)
            expected = replicated * num_params + sharded * ceil_div(num_params, world_size)
            assert est.model_states == expected, (num_params, world_size)


def test_each_buffer_of_mixed_and_fp32_training():
    psi, n = 1000, 3  # shard 334: the last rank's shard is padded by 2
    mixed = {e.stage: e for e in estimate_all_stages(psi, world_size=n, dtype="bf16")}
    assert shard_numel(psi, n) == 334
    assert (mixed[0].parameters, mixed[0].gradients, mixed[0].optimizer_states) == (2000, 2000, 12000)
    assert (mixed[1].parameters, mixed[1].gradients, mixed[1].optimizer_states) == (2000, 2000, 12 * 334)
    assert (mixed[2].parameters, mixed[2].gradients, mixed[2].optimizer_states) == (2000, 2 * 334, 12 * 334)
    assert (mixed[3].parameters, mixed[3].gradients, mixed[3].optimizer_states) == (2 * 334, 2 * 334, 12 * 334)
    fp32 = estimate_memory(psi, world_size=n, stage=0, dtype="fp32")
    # fp32: the master weights are the parameters, so Adam's two states are all the optimizer adds
    assert (fp32.parameters, fp32.gradients, fp32.optimizer_states) == (4000, 4000, 8000)
    sgd = estimate_memory(psi, world_size=n, stage=1, dtype="bf16", optimizer="sgd")
    assert sgd.optimizer_states == (4 + 4) * 334


def test_frozen_parameters_cost_their_bytes_whole_at_stages_0_to_2_and_sharded_at_3():
    psi, phi, n = 1000, 7001, 8  # Φ's shard 876, padded
    for stage in range(4):
        plain = estimate_memory(psi, world_size=n, stage=stage, dtype="bf16")
        with_frozen = estimate_memory(psi, world_size=n, stage=stage, dtype="bf16", frozen=phi)
        held = 2 * (876 if stage == 3 else phi)
        assert with_frozen.parameters == plain.parameters + held
        assert (with_frozen.gradients, with_frozen.optimizer_states, with_frozen.buckets) == \
            (plain.gradients, plain.optimizer_states, plain.buckets)  # no gradient, state or bucket
    offloaded = estimate_memory(psi, world_size=n, stage=3, dtype="bf16", frozen=phi, offload_optimizer="nvme",
                                offload_param="nvme")
    assert offloaded.parameters == 2 * 876  # the trained shards go to the swap files, the frozen stay
    assert formula(3, "bf16", frozen=True) == "16Ψ/N + 2Φ/N"
    assert formula(1, "fp32", frozen=True) == "8Ψ + 8Ψ/N + 4Φ"
    with pytest.raises(ValueError, match="frozen parameter count"):
        estimate_memory(psi, world_size=n, stage=0, frozen=-1)


def test_formula_strings_match_design():
    assert [formula(s, "bf16") for s in range(4)] == ["16Ψ", "4Ψ + 12Ψ/N", "2Ψ + 14Ψ/N", "16Ψ/N"]
    assert [formula(s, "fp32") for s in range(4)] == ["16Ψ", "8Ψ + 8Ψ/N", "4Ψ + 12Ψ/N", "16Ψ/N"]


def test_buckets_are_capped_by_the_model():
    big = estimate_memory(10**10, world_size=8, stage=2, dtype="bf16", reduce_bucket_size=5e8, allgather_bucket_size=2e8)
    assert big.buckets == 5 * 10**8 * 2 + 2 * 10**8 * 2
    small = estimate_memory(1000, world_size=8, stage=0, dtype="fp32")
    assert small.buckets == 1000 * 4  # stage 0: one gradient bucket, no all-gather bucket


def test_activations_follow_korthikanti_and_add_to_total():
    s, b, h, a, layers = 1024, 4, 768, 12, 12
    bf16 = activation_bytes(hidden=h, layers=layers, seq_len=s, micro_batch=b, heads=a, dtype="bf16")
    assert bf16 == layers * s * b * h * (34 + 5 * a * s / h)
    fp32 = activation_bytes(hidden=h, layers=layers, seq_len=s, micro_batch=b, heads=a, dtype="fp32")
    assert fp32 == layers * (s * b * h * 66 + a * s * s * b * 9)
    checkpointed = activation_bytes(hidden=h, layers=layers, seq_len=s, micro_batch=b, heads=a, checkpointing=True)
    assert checkpointed == layers * s * b * h * 2 + bf16 // layers
    est = estimate_memory(125_000_000, world_size=2, stage=1, dtype="bf16", hidden=h, layers=layers, seq_len=s,
                          micro_batch=b, heads=a)
    assert est.activations == bf16 and est.total == est.model_states + est.buckets + bf16
    with pytest.raises(ValueError, match="missing seq_len, micro_batch"):
        estimate_memory(10, world_size=2, stage=0, hidden=8, layers=2)


@pytest.mark.parametrize("text, value", [
    ("7B", 7 * 10**9), ("125M", 125 * 10**6), ("1.1B", 1_100_000_000), ("350k", 350_000), ("1.5T", 1_500_000_000_000),
    ("7e9", 7 * 10**9), ("1_000", 1000), ("42", 42), (" 2G ", 2 * 10**9), (5e8, 500_000_000),
])
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["7Q", "", "-3", "0", "1.5", "seven"])
def test_parse_count_rejects(text):
    with pytest.raises(ValueError):
        parse_count(text)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="stage must be"):
        estimate_memory(10, world_size=2, stage=4)
    with pytest.raises(ValueError, match="dtype must be one of"):
        estimate_memory(10, world_size=2, stage=0, dtype="int8")
    with pytest.raises(ValueError, match="world_size"):
        estimate_memory(10, world_size=0, stage=0)


def test_thousand_gpu_scale():
    psi, n = 10**12, 1024
    est = estimate_memory(psi, world_size=n, stage=3, dtype="bf16")
    assert est.model_states == 16 * ceil_div(psi, n) == 15_625_000_000


def test_cli_prints_all_stages(capsys):
    assert main(["estimate", "--params", "7B", "--world-size", "1000", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "7,000,000,000 parameters" in out and "1,000 ranks" in out
    for design in ["16Ψ =", "4Ψ + 12Ψ/N", "2Ψ + 14Ψ/N", "16Ψ/N"]:
        assert design in out
    assert "104.31 GiB" in out  # 16 * 7e9 bytes at stage 0
    assert main(["estimate", "--params", "125M", "--world-size", "2", "--stage", "3", "--hidden", "768",
                 "--layers", "12", "--seq-len", "1024", "--micro-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "16Ψ/N" in out and "4Ψ" not in out.split("\n", 2)[2]
    assert main(["estimate", "--params", "40M", "--frozen-params", "7B", "--world-size", "8", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "7,000,000,000 frozen (Φ)" in out and "16Ψ/N + 2Φ/N = 1.70 GiB" in out  # LoRA on a 7B base
    with pytest.raises(SystemExit, match="cannot read '7Q'"):
        main(["estimate", "--params", "7Q", "--world-size", "2"])
