"""Offload through the engine on 2 gloo ranks: `offload_optimizer: nvme` at stages 1, 2 and 3
gives parameters and optimizer state bitwise those of the in-memory run, with swap files under
nvme_path while it trains, the bytes each step moves equal to the formula, and errors agreed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from zerodist.models.toy import make_mlp

STEPS, MICRO, IN, OUT = 5, 4, 256, 16
SUB_GROUP = 500_000


def _config(stage: int, offload: dict | None, sub_group: int, bf16: bool = False) -> dict:
    section = {"stage": stage, "sub_group_size": sub_group}
    if offload is not None:
        section["offload_optimizer"] = offload
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": section}


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(MICRO, IN, generator=generator), torch.randn(MICRO, OUT, generator=generator)


def _proc_io() -> dict[str, int]:
    with open("/proc/self/io", encoding="utf-8") as file:
        return {key: int(value) for key, value in (line.split(": ") for line in file)}


def _train(stage: int, offload: dict | None, hidden: int, sub_group: int, nvme_path: str | None = None,
           bf16: bool = False) -> dict:
    import zerodist

    model = make_mlp(IN, hidden, OUT, layers=4, seed=0)
    engine, *_ = zerodist.initialize(model=model, config=_config(stage, offload, sub_group, bf16))
    rank = engine.global_rank
    files_seen, moved = [], []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        engine.backward(torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16 if bf16 else torch.float32)).float(), y))
        inner = engine.zero_state.inner_optimizer
        before = inner.directory.counters.snapshot() if nvme_path else None
        io_before = _proc_io()
        engine.step()
        if nvme_path:  # the step's last writes finish after it returns
            inner.settle()
        io_after = _proc_io()
        if nvme_path:
            files_seen.append(sorted(p.name for p in Path(nvme_path).glob(f"*/rank{rank}/*.swp")))
            after = inner.directory.counters
            moved.append((after.bytes_read - before.bytes_read, after.bytes_written - before.bytes_written))
            # The kernel's count of this process's read and write calls covers the swapper's (and more).
            assert io_after["rchar"] - io_before["rchar"] >= moved[-1][0]
            assert io_after["wchar"] - io_before["wchar"] >= moved[-1][1]
    zero = engine.zero_state
    optimizer = {f"{g}.{i}": {k: v.clone() for k, v in zero.inner_optimizer.state[t].items()}
                 for g, group in enumerate(zero.groups) for i, t in enumerate(group.optimizer_tensors)}
    result = {"params": engine.module_state_dict(), "optimizer": optimizer, "files": files_seen, "moved": moved,
              "shard_numel": sum(g.layout.shard_numel for g in zero.groups),
              "swapped": zero.optimizer.swapped_state_bytes(), "resident": zero.optimizer.state_bytes()}
    engine.destroy()
    result["left"] = sorted(str(p) for p in Path(nvme_path).glob(f"*/rank{rank}")) if nvme_path else []
    return result


def _compare(stage: int, hidden: int, sub_group: int, nvme_path: str, offload_extra: dict, bf16: bool = False) -> dict:
    """Both runs on this rank, compared here (only the facts go back to the test)."""
    reference = _train(stage, None, hidden, sub_group, bf16=bf16)
    offload = {"device": "nvme", "nvme_path": nvme_path, **offload_extra}
    swapped = _train(stage, offload, hidden, sub_group, nvme_path, bf16=bf16)
    for key, value in reference["params"].items():
        assert torch.equal(swapped["params"][key], value), key
    assert reference["optimizer"].keys() == swapped["optimizer"].keys()
    for key, state in reference["optimizer"].items():
        assert state.keys() == swapped["optimizer"][key].keys(), key
        for name, value in state.items():
            assert torch.equal(swapped["optimizer"][key][name], value), (key, name)
    return {k: swapped[k] for k in ("files", "moved", "shard_numel", "swapped", "left", "resident")} | {
        "reference_resident": reference["resident"], "bf16": bf16}


def _check_facts(facts: list[dict]) -> None:
    for rank, fact in enumerate(facts):
        # Swap files exist while training, one per sub-group, and are gone after destroy().
        assert all(names and names == fact["files"][0] for names in fact["files"]), fact["files"]
        assert fact["left"] == []
        # Bytes per step per rank: Adam's two fp32 states of the padded shard (8 Ψ/N), and under bf16
        # the fp32 master (4 Ψ/N), each region rounded up to 64 bytes; the first step creates the state:
        # it reads only the master (its exact bytes) and writes everything.
        state = (12 if fact["bf16"] else 8) * fact["shard_numel"]
        assert fact["moved"][0] == (4 * fact["shard_numel"] if fact["bf16"] else 0, fact["swapped"])
        for read, written in fact["moved"][1:]:
            assert read == written == fact["swapped"]
            assert state <= read <= state + 3 * 64 * len(fact["files"][0])
        # Memory accounting: the Adam state (and the bf16 run's fp32 master) left memory for the files.
        assert fact["reference_resident"] - fact["resident"] == state


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_offload_is_bitwise_the_in_memory_run(tmp_path, stage, bf16):
    # 264K parameters, sub-groups of 20K elements: the shard streams through 2 buffers in 7 sub-groups.
    facts = run_distributed(_compare, 2, stage, 300, 20_000, str(tmp_path),
                            {"pipeline_read": True, "pipeline_write": True, "buffer_count": 2}, bf16, timeout=120)
    _check_facts(facts)
    assert len(facts[0]["files"][0]) == 7


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_offload_29m_parameters_is_bitwise_the_in_memory_run(tmp_path, stage):
    # 256 -> 3750 -> 3750 -> 3751 -> 16: 29.1M parameters; sub-groups of 5e5 elements.
    pipelined = stage != 2  # one stage streams serially, so both paths are compared at full size
    facts = run_distributed(_compare, 2, stage, 3750, SUB_GROUP, str(tmp_path),
                            {"pipeline_read": pipelined, "pipeline_write": pipelined, "buffer_count": 3},
                            timeout=400)
    _check_facts(facts)
    assert len(facts[0]["files"][0]) >= 29  # 14.6M elements per rank in sub-groups of 5e5


def _cpu_offload_changes_nothing(stage: int) -> None:
    reference = _train(stage, None, 300, 20_000)
    config = _config(stage, {"device": "cpu", "pin_memory": True}, 20_000)
    if stage == 3:
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    offloaded = _train_config(config, 300)
    for key, value in reference["params"].items():
        assert torch.equal(offloaded[key], value), key


def _train_config(config: dict, hidden: int) -> dict:
    import zerodist
    from tests.debug_helpers import captured_logs

    model = make_mlp(IN, hidden, OUT, layers=4, seed=0)
    with captured_logs() as messages:
        engine, *_ = zerodist.initialize(model=model, config=config)
    lines = [m for m in messages if m.startswith("offload:")]
    assert len(lines) == (1 if engine.global_rank == 0 else 0), lines
    for step in range(STEPS):
        x, y = _batch(step, engine.global_rank)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    params = engine.module_state_dict()
    engine.destroy()
    return params


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_offload_on_cpu_parameters_is_accepted_with_one_info_line_and_changes_nothing(stage):
    run_distributed(_cpu_offload_changes_nothing, 2, stage, timeout=120)


def _scheduled_accumulated(nvme_path: str) -> None:
    """A scheduler's learning rate reaches the swapped optimizer, and accumulation steps it once."""
    import zerodist
    from zerodist.models import make_mlp

    results = []
    for path in (None, nvme_path):
        zero: dict = {"stage": 1, "sub_group_size": 300}
        if path:
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path, "pipeline_read": True}
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.01}},
                  "zero_optimization": zero}
        engine = zerodist.initialize(model=make_mlp(), config=config)[0]
        for step in range(8):
            generator = torch.Generator().manual_seed(step * 2 + engine.global_rank)
            x, y = torch.randn(2, 16, generator=generator), torch.randn(2, 8, generator=generator)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
        results.append((engine.module_state_dict(), engine.get_lr()))
        engine.destroy()
    assert results[0][1] == results[1][1]
    for key, value in results[0][0].items():
        assert torch.equal(results[1][0][key], value), key


def test_scheduler_and_accumulation_with_swapped_state(tmp_path):
    run_distributed(_scheduled_accumulated, 2, str(tmp_path), timeout=90)
