"""`offload_param: nvme` at stage 3 on 2 gloo ranks: the parameter shards live in the optimizer's
swap files (with `offload_optimizer: nvme`), are read before each gather and stepped there; the
parameters and every optimizer-state tensor are bitwise the in-memory run's, the bytes each
iteration moves equal the formula of docs/design/offload.md, checkpoints save and resume across
offload, and a damaged file is the same named error on every rank."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed
from zerodist.models.toy import make_mlp

STEPS, MICRO, IN, OUT = 5, 4, 256, 16


def _config(sub_group: int, nvme_path: str | None, bf16: bool = False, optimizer_device: str = "nvme") -> dict:
    # Each Linear is a unit, re-gathered in backward (reuse distance 0); biases stay whole (persistent).
    zero: dict = {"stage": 3, "sub_group_size": sub_group, "stage3_max_reuse_distance": 0,
                  "stage3_param_persistence_threshold": 4000}
    if nvme_path is not None:
        zero["offload_optimizer"] = {"device": optimizer_device, "nvme_path": nvme_path, "pipeline_read": True,
                                     "pipeline_write": True, "buffer_count": 3}
        zero["offload_param"] = {"device": "nvme"}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0, "steps_per_print": 10**9,
            "bf16": {"enabled": bf16}, "zerodist": {"stage3_unit_classes": ["Linear"]},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}, "zero_optimization": zero}


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(MICRO, IN, generator=generator), torch.randn(MICRO, OUT, generator=generator)


def _proc_io() -> dict[str, int]:
    with open("/proc/self/io", encoding="utf-8") as file:
        return {key: int(value) for key, value in (line.split(": ") for line in file)}


def _gather_bytes(engine) -> int:
    """Bytes one forward and backward read for the gathers: each unit's offloaded shards (4 bytes per
    element: fp32, or the fp32 master a bf16 shard is cast from), once in forward and again in
    backward unless the unit stays gathered in between (the root and the kept units)."""
    runtime = engine.units
    total = 0
    for unit in runtime.units:
        times = 1 if unit is runtime.root or unit.index in runtime.kept else 2
        total += times * sum(4 * g.layout.shard_numel for g in unit.groups if g.shard_offloaded)
    return total


def _train(config: dict, hidden: int, nvme_path: str | None) -> dict:
    import zerodist

    model = make_mlp(IN, hidden, OUT, layers=4, seed=0)
    engine, *_ = zerodist.initialize(model=model, config=config)
    rank, zero = engine.global_rank, engine.zero_state
    counters = zero.inner_optimizer.directory.counters if nvme_path else None
    snapshots, io, files = [counters.snapshot() if counters else None], [_proc_io()], []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        dtype = torch.bfloat16 if config["bf16"]["enabled"] else torch.float32
        engine.backward(F.mse_loss(engine(x.to(dtype)).float(), y))
        engine.step()
        if nvme_path:  # the step's last writes finish after it returns
            zero.inner_optimizer.settle()
        if step == 0:  # the next forward's first units, gathered at the end of the step ([Note: early gather])
            early = sum(4 * g.layout.shard_numel for u in engine.units._early for g in u.groups if g.shard_offloaded)
        snapshots.append(counters.snapshot() if counters else None)
        io.append(_proc_io())
        if nvme_path:
            files.append(sorted(p.name for p in Path(nvme_path).glob(f"*/rank{rank}/*.swp")))
    optimizer = {f"{g}.{i}": {k: v.clone() for k, v in zero.inner_optimizer.state[t].items()}
                 for g, group in enumerate(zero.groups) for i, t in enumerate(group.optimizer_tensors)}
    result = {"params": engine.module_state_dict(), "optimizer": optimizer, "files": files,
              "held": sum(g.layout.shard_numel for g in zero.groups if g.stepped_store is not None),
              "offloaded": sum(g.layout.shard_numel for g in zero.groups if g.shard_offloaded),
              "gather": _gather_bytes(engine) if nvme_path else 0, "early": early,
              "model_states": engine.model_state_bytes()}
    if counters:
        result["files_bytes"] = zero.optimizer.swapped_state_bytes()
        result["moved"] = [(b.bytes_read - a.bytes_read, b.bytes_written - a.bytes_written)
                           for a, b in zip(snapshots, snapshots[1:])]
        result["io"] = [(b["rchar"] - a["rchar"], b["wchar"] - a["wchar"]) for a, b in zip(io, io[1:])]
    engine.destroy()
    result["left"] = sorted(str(p) for p in Path(nvme_path).glob(f"*/rank{rank}")) if nvme_path else []
    return result


def _compare(hidden: int, sub_group: int, nvme_path: str, bf16: bool) -> dict:
    reference = _train(_config(sub_group, None, bf16), hidden, None)
    swapped = _train(_config(sub_group, nvme_path, bf16), hidden, nvme_path)
    for key, value in reference["params"].items():
        assert torch.equal(swapped["params"][key], value), key
    assert reference["optimizer"].keys() == swapped["optimizer"].keys()
    for key, state in reference["optimizer"].items():
        assert state.keys() == swapped["optimizer"][key].keys(), key
        for name, value in state.items():
            assert torch.equal(swapped["optimizer"][key][name], value), (key, name)
    facts = {k: swapped[k] for k in ("files", "held", "offloaded", "gather", "early", "files_bytes", "moved", "io",
                                     "left")}
    facts["params_left_memory"] = reference["model_states"]["params"] - swapped["model_states"]["params"]
    return facts


def _check_facts(facts: list[dict], bf16: bool) -> None:
    for fact in facts:
        # Swap files exist while training, one per sub-group, and are gone after destroy().
        assert fact["files"][0] and all(names == fact["files"][0] for names in fact["files"]), fact["files"]
        assert fact["left"] == []
        assert fact["offloaded"] > 0 and fact["gather"] > 0
        # The shard left memory: 4 (fp32) or 2 (bf16) bytes per offloaded shard element.
        assert fact["params_left_memory"] == (2 if bf16 else 4) * fact["offloaded"]
        # Per iteration (forward, backward, step) per rank: the gathers read their shards (`gather`),
        # the step reads and writes every sub-group file once (`files_bytes`: Adam's 8 bytes per stepped
        # element and 4 per held one, each region rounded up to 64 bytes). The first step creates the
        # state: it reads only the held values (their exact bytes), and its iteration also gathered the
        # first forward's units itself, besides those the step gathered early for the next forward.
        state = 8 * fact["held"] if bf16 else None
        first_read, first_written = fact["moved"][0]
        assert fact["early"] > 0
        assert first_read == 4 * fact["held"] + fact["gather"] + fact["early"], fact["moved"]
        assert first_written == fact["files_bytes"]
        for read, written in fact["moved"][1:]:
            assert read == fact["files_bytes"] + fact["gather"] and written == fact["files_bytes"], fact["moved"]
        if state is not None:  # bf16: every group's master is held, so 12 bytes per stepped element
            assert 12 * fact["held"] <= fact["files_bytes"] <= 12 * fact["held"] + 3 * 64 * len(fact["files"][0])
        # The kernel's count of this process's read and write calls covers the swapper's.
        for (read, written), (rchar, wchar) in zip(fact["moved"], fact["io"]):
            assert rchar >= read and wchar >= written


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_offload_param_nvme_is_bitwise_the_in_memory_run(tmp_path, bf16):
    # 264K parameters, sub-groups of 20K elements: held shards and whole (persistent) biases share files.
    facts = run_distributed(_compare, 2, 300, 20_000, str(tmp_path), bf16, timeout=150)
    _check_facts(facts, bf16)
    assert len(facts[0]["files"][0]) == 7


@pytest.mark.slow
def test_offload_param_nvme_29m_parameters_is_bitwise_the_in_memory_run(tmp_path):
    # 256 -> 3750 -> 3750 -> 3751 -> 16: 29.1M parameters; sub-groups of 5e5 elements.
    facts = run_distributed(_compare, 2, 3750, 500_000, str(tmp_path), False, timeout=500)
    _check_facts(facts, False)
    assert len(facts[0]["files"][0]) >= 29  # 14.6M elements per rank in sub-groups of 5e5


def _refused(config: dict) -> str:
    import zerodist
    from zerodist.config import ConfigError

    try:
        zerodist.initialize(model=make_mlp(IN, 32, OUT, layers=2), config=config)
    except ConfigError as error:
        return str(error)
    raise AssertionError("no error")


@pytest.mark.parametrize("optimizer_device", ["none", "cpu"])
def test_offload_param_nvme_without_optimizer_nvme_is_refused_by_name(tmp_path, optimizer_device):
    config = _config(20_000, str(tmp_path), optimizer_device=optimizer_device)
    messages = run_distributed(_refused, 2, config, timeout=60)
    assert messages[0] == messages[1]
    assert f"offload_optimizer.device is \"{optimizer_device}\"" in messages[0] and "to \"nvme\" too" in messages[0]


def test_offload_param_nvme_path_other_than_the_optimizers_is_refused_by_name(tmp_path):
    config = _config(20_000, str(tmp_path))
    config["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path / "elsewhere")
    message = run_distributed(_refused, 1, config, timeout=60)[0]
    assert "offload_param.nvme_path" in message and "make them equal" in message


def _truncate_then_train(nvme_path: str) -> str:
    import zerodist
    from zerodist.offload import SwapFileError

    engine = zerodist.initialize(model=make_mlp(IN, 300, OUT, layers=4, seed=0),
                                 config=_config(20_000, nvme_path))[0]
    for step in range(2):
        x, y = _batch(step, engine.global_rank)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    if engine.global_rank == 1:
        for victim in engine.zero_state.inner_optimizer.directory.path.glob("*.swp"):
            with open(victim, "r+b") as file:
                file.truncate(10)
    try:
        x, y = _batch(2, engine.global_rank)
        engine.backward(F.mse_loss(engine(x), y))  # the gathers read the shards (backward re-gathers)
        engine.step()
    except SwapFileError as error:
        return str(error)
    finally:
        engine.destroy()
    raise AssertionError("no error")


def test_truncated_param_swap_file_is_one_named_error_on_every_rank(tmp_path):
    messages = run_distributed(_truncate_then_train, 2, str(tmp_path), timeout=90)
    assert "holds 10 bytes" in messages[1] and "truncated" in messages[1]
    assert messages[0].startswith("on rank 1: swap file") and messages[0].endswith(messages[1])


def _steps(engine, first: int, last: int) -> list[float]:
    losses = []
    for step in range(first, last):
        x, y = _batch(step, engine.global_rank)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _save_and_resume_across_param_offload(save_dir: str, nvme_path: str) -> None:
    import zerodist

    def build(nvme: str | None):
        return zerodist.initialize(model=make_mlp(IN, 300, OUT, layers=4, seed=0),
                                   config=copy.deepcopy(_config(20_000, nvme)))[0]

    whole = build(None)
    expected = _steps(whole, 0, 6)
    expected_state = whole.module_state_dict()
    whole.destroy()
    for saved_with in (nvme_path, None):
        saving = build(saved_with)
        _steps(saving, 0, 3)
        tag = f"saved-{'offloaded' if saved_with else 'in-memory'}"
        saving.save_checkpoint(save_dir, tag=tag)
        saving.destroy()
        for nvme in (None, nvme_path) if saved_with else (nvme_path,):
            resumed = build(nvme)
            resumed.load_checkpoint(save_dir, tag=tag)
            assert _steps(resumed, 3, 6) == expected[3:], (tag, nvme)
            state = resumed.module_state_dict()
            resumed.destroy()
            for key, value in expected_state.items():
                assert torch.equal(state[key], value), (tag, nvme, key)


def test_checkpoint_with_offloaded_param_shards_resumes_with_or_without_offload(tmp_path):
    (tmp_path / "nvme").mkdir()
    run_distributed(_save_and_resume_across_param_offload, 2, str(tmp_path / "ckpt"), str(tmp_path / "nvme"),
                    timeout=240)


def _modify_gathered(nvme_path: str) -> None:
    """GatheredParameters with a modifier rank writes the new values through the swap files."""
    import zerodist

    results = []
    for path in (None, nvme_path):
        engine = zerodist.initialize(model=make_mlp(IN, 300, OUT, layers=4, seed=0),
                                     config=_config(20_000, path))[0]
        _steps(engine, 0, 1)
        weight = engine.module[0].weight
        with zerodist.zero.GatheredParameters([weight], modifier_rank=0):
            halved = weight.detach() * 0.5
            if engine.global_rank == 0:
                weight.data.mul_(0.5)
        with zerodist.zero.GatheredParameters([weight]):  # every rank reads the change back (from the files)
            assert torch.equal(weight.detach(), halved)
        _steps(engine, 1, 3)
        results.append(engine.module_state_dict())
        engine.destroy()
    for key, value in results[0].items():
        assert torch.equal(results[1][key], value), key


def test_gathered_parameters_with_a_modifier_rank_writes_through_the_swap_files(tmp_path):
    run_distributed(_modify_gathered, 2, str(tmp_path), timeout=120)


def _pretrained_into_offloaded(directory: str, nvme_path: str) -> None:
    """load_pretrained writes each rank's owned runs through the swap files (fp32 and bf16)."""
    import zerodist
    from zerodist.checkpoint import load_pretrained

    weights = {k: v * 0.5 for k, v in make_mlp(IN, 300, OUT, layers=4, seed=1).state_dict().items()}
    if torch.distributed.get_rank() == 0:
        torch.save(weights, f"{directory}/pytorch_model.bin")
    torch.distributed.barrier()
    for bf16 in (False, True):
        results = []
        for path in (None, nvme_path):
            engine = zerodist.initialize(model=make_mlp(IN, 300, OUT, layers=4, seed=0),
                                         config=_config(20_000, path, bf16))[0]
            load_pretrained(engine, directory)
            loaded = engine.module_state_dict()
            for key, value in weights.items():
                assert torch.equal(loaded[key].float(), value.to(loaded[key].dtype).float()), (bf16, path, key)
            dtype = torch.bfloat16 if bf16 else torch.float32
            for step in range(2):
                x, y = _batch(step, engine.global_rank)
                engine.backward(F.mse_loss(engine(x.to(dtype)).float(), y))
                engine.step()
            results.append(engine.module_state_dict())
            engine.destroy()
        for key, value in results[0].items():
            assert torch.equal(results[1][key], value), (bf16, key)


def test_load_pretrained_writes_through_the_swap_files(tmp_path):
    (tmp_path / "nvme").mkdir()
    run_distributed(_pretrained_into_offloaded, 2, str(tmp_path), str(tmp_path / "nvme"), timeout=180)


def _load_into_a_rank_whose_disk_fails(save_dir: str, nvme_path: str) -> str:
    """A checkpoint loaded into an engine whose shards live in swap files: rank 1's swap writes fail
    (its disk filled up); every rank raises the same named error, none waits in the next gather."""
    import zerodist
    from zerodist.offload import SwapSpaceError

    saving = zerodist.initialize(model=make_mlp(IN, 300, OUT, layers=4, seed=0), config=_config(20_000, None))[0]
    _steps(saving, 0, 1)
    saving.save_checkpoint(save_dir, tag="saved")
    saving.destroy()
    engine = zerodist.initialize(model=make_mlp(IN, 300, OUT, layers=4, seed=0),
                                 config=copy.deepcopy(_config(20_000, nvme_path)))[0]
    directory = engine.zero_state.inner_optimizer.directory
    if engine.global_rank == 1:
        def full_disk(*args, **kwargs):
            raise SwapSpaceError("no space left on the swap device (the test's full disk)")
        directory.write = directory.write_at = full_disk  # the library's own object, not the user's model
    try:
        engine.load_checkpoint(save_dir, tag="saved")
    except SwapSpaceError as error:
        return str(error)
    finally:
        engine.destroy()
    raise AssertionError("no error")


def test_a_swap_write_failing_on_one_rank_during_load_is_one_named_error_on_every_rank(tmp_path):
    (tmp_path / "nvme").mkdir()
    messages = run_distributed(_load_into_a_rank_whose_disk_fails, 2, str(tmp_path / "ckpt"),
                               str(tmp_path / "nvme"), timeout=90)
    assert messages[1] == "no space left on the swap device (the test's full disk)"
    assert messages[0] == "on rank 1: " + messages[1]
