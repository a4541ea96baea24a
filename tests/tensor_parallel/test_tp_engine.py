"""ZeRO stages 0-3 x tensor parallelism on a data=2 x tensor=2 mesh, through zerodist.initialize."""

import pytest
import torch

import zerodist
import zerodist.comm as comm
from zerodist.comm.domains import parameter_placements
from zerodist.debug import check_weight_sync
from zerodist.models.gpt import GPT, GPTConfig
from zerodist.tensor_parallel import ColumnParallelLinear, DominoBlock, HeadParallelAttention, schedule_log
from zerodist.train.report import state_formula_bytes
from zerodist.zero import GatheredParameters
from tests.harness import distributed_test

pytestmark = pytest.mark.multiprocess

SHAPE = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=32)
MICRO = 2
LR, EPS, CLIP = 1e-2, 1e-6, 0.5  # eps: see test_tp_parallelize (a key bias's gradient is exactly zero)


def _config(stage, tensor, **zerodist_section):
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.01}},
        "gradient_clipping": CLIP, "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "tensor_parallel": {"autotp_size": tensor},
    }
    if zerodist_section:
        config["zerodist"] = {"tensor_parallel": zerodist_section}
    return config


def _batch(step, rows):
    generator = torch.Generator().manual_seed(500 + step)
    return (torch.randint(0, 64, (rows, 8), generator=generator), torch.randint(0, 64, (rows, 8), generator=generator))


def _reference(steps, rows):
    torch.manual_seed(0)
    model = GPT(SHAPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
    norms = []
    for step in range(steps):
        idx, targets = _batch(step, rows)
        optimizer.zero_grad()
        model(idx, targets).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
    return model.state_dict(), norms


def _train(config, steps):
    torch.manual_seed(0)
    engine, _, _, _ = zerodist.initialize(model=GPT(SHAPE), config=config)
    shards, shard = engine.topology.num_batch_shards, engine.topology.batch_rank
    for step in range(steps):
        idx, targets = _batch(step, MICRO * shards)
        rows = slice(shard * MICRO, (shard + 1) * MICRO)
        engine.backward(engine(idx[rows], targets[rows]))
        engine.step()
    return engine


def _relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-12)).item()


def _replicated_equal_across_tensor_ranks(engine):
    placements = parameter_placements(engine.module)
    group = engine.topology.group("tensor")
    for name, param in engine.module.named_parameters():
        if "tensor" not in placements[id(param)].domain.replicated_axes:
            continue
        with GatheredParameters([param], enabled=engine.stage3 is not None):
            value = param.detach().clone()
        everyone = [None] * engine.topology.size("tensor")
        comm.all_gather_object(everyone, value, group=group)
        assert all(torch.equal(everyone[0], other) for other in everyone[1:]), f"{name} differs across tensor ranks"


@distributed_test(world_size=4, timeout=240)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_on_a_data_by_tensor_mesh_match_one_process(stage):
    steps = 10
    engine = _train(_config(stage, tensor=2), steps)
    assert dict(engine.topology.degrees) == {"pipe": 1, "data": 2, "expert": 1, "sequence": 1, "tensor": 2}
    assert isinstance(engine.module.blocks[0].attn, HeadParallelAttention)
    reference, norms = _reference(steps, rows=MICRO * 2)
    state = engine.module_state_dict()  # unsliced: the names and shapes of the plain GPT
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in reference.items()}
    for key, expected in reference.items():
        assert _relative_error(state[key], expected) <= 1e-5, f"{key}: {_relative_error(state[key], expected):.2e}"
    assert engine.get_global_grad_norm() == pytest.approx(norms[-1], rel=1e-5)  # every element counted once
    assert norms[-1] > CLIP  # clipping was active, so a wrong norm would show in the parameters
    _replicated_equal_across_tensor_ranks(engine)

    # Model state per rank: docs/design/zero.md's formula with the tensor-local (padded) parameter count,
    # over the data degree.
    psi = sum(g.layout.total_numel for g in engine.groups)
    local = sum(p.numel() for p in engine.module.parameters())
    assert local < sum(p.numel() for p in GPT(SHAPE).parameters()) and psi >= local
    assert engine.model_state_bytes()["total"] == state_formula_bytes(stage, False, psi, 2)


@distributed_test(world_size=4, timeout=240)
@pytest.mark.parametrize("stage, settings", [(2, {"sequence_parallel": True}), (3, {"sequence_parallel": True}),
                                             (2, {"domino": {"chunks": 2, "overlap": "inter"}}),
                                             (3, {"domino": {"chunks": 2, "overlap": "intra"}}),
                                             (3, {"domino": {"chunks": 2, "overlap": "inter"}})])
def test_sequence_parallel_and_domino_through_initialize(stage, settings):
    steps = 4
    config = _config(stage, tensor=2, **settings)
    if stage == 3:  # each block released right after its forward, so a read after release shows
        config["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    engine = _train(config, steps)
    if "domino" in settings:
        assert isinstance(engine.module.blocks[0], DominoBlock)
    else:
        assert engine.module.blocks[0].attn.qkv.sequence_parallel
    reference, _ = _reference(steps, rows=MICRO * 2)
    state = engine.module_state_dict()
    for key, expected in reference.items():
        assert _relative_error(state[key], expected) <= 1e-5, f"{key}: {_relative_error(state[key], expected):.2e}"
    _replicated_equal_across_tensor_ranks(engine)
    if settings.get("domino", {}).get("overlap") == "inter":
        # at stage 3 too ([Note: Domino at ZeRO-3]): block 0's last reductions wait under block 1's first chunks
        idx, targets = _batch(steps, MICRO * engine.topology.num_batch_shards)
        rows = slice(engine.topology.batch_rank * MICRO, (engine.topology.batch_rank + 1) * MICRO)
        with schedule_log() as log:
            engine.backward(engine(idx[rows], targets[rows]))
        assert log.overlap_fraction("forward") >= 0.9
        assert all(computes >= 1 for _, computes, _ in log.windows("forward"))
    if stage == 3:
        return
    # check_weight_sync compares each parameter over its replicated axes (slices differ across
    # tensor ranks by design), and catches a LayerNorm that drifted on one tensor rank.
    assert check_weight_sync(engine).ok
    if engine.topology.coords["tensor"] == 1:
        with torch.no_grad():
            engine.module.ln_f.weight.add_(1e-3)
    report = check_weight_sync(engine)
    assert not report.ok and [p.name for p in report.mismatched] == ["ln_f.weight"]
    assert "ln_f.weight: ranks 1, 3 differ" in report.format()  # the tensor-rank-1 copies, by global rank


@distributed_test(world_size=2)
def test_a_model_without_a_plan_is_a_named_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="needs a plan for Sequential"):
        zerodist.initialize(model=model, config=_config(0, tensor=2))
    config = _config(0, tensor=2)
    config["tensor_parallel"]["partition_config"] = {
        "layer_specs": [{"patterns": [r"^0\.weight$"], "partition_type": "column", "gather_output": True}]}
    engine, _, _, _ = zerodist.initialize(model=torch.nn.Sequential(torch.nn.Linear(4, 4)), config=config)
    assert isinstance(engine.module[0], ColumnParallelLinear) and engine.module[0].gather_output


def _train_cli_in_place(out):
    import argparse
    import contextlib
    import io

    from zerodist.cli.train import build_plan
    from zerodist.cli.train import train_in_place as train  # runs and prints what rank 0 reports

    args = argparse.Namespace(model="tiny", steps=3, config=None, out=out, stage=None, micro_batch=2, lr=None,
                              bf16=False, fp16=False, seed=None, save_interval=None, resume=False, tp=2, domino=2,
                              moe=None)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = train(build_plan(args, comm.get_world_size()))
    return code, printed.getvalue()


def test_zerodist_train_tp_2_with_domino_on_4_ranks(tmp_path):
    from tests.harness import run_distributed

    results = run_distributed(_train_cli_in_place, 4, str(tmp_path), timeout=240)
    assert [code for code, _ in results] == [0, 0, 0, 0]
    text = results[0][1]
    assert "tensor parallel (degree 2)" in text and text.count("matches") >= 4 + 2  # 4 ranks' state, TP bytes
    assert "Domino 2 chunks: 100% of forward" in text


def _llama_through_initialize(pre_parallelized, domino=None):
    import copy

    from tests.tensor_parallel.test_tp_parallelize import _tiny_llama
    from zerodist.tensor_parallel import hf_llama_plan, parallelize

    reference = _tiny_llama(heads=4).float()
    model = copy.deepcopy(reference)
    if pre_parallelized:  # the Python form: the user parallelizes, initialize keeps it
        model = parallelize(model, hf_llama_plan(model), comm.Topology(tensor=2))
    config = _config(2, tensor=2, **({"domino": domino} if domino else {}))
    config["train_micro_batch_size_per_gpu"] = 4
    engine, _, _, _ = zerodist.initialize(model=model, config=config)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
    for step in range(3):
        idx, targets = _batch(step, 4)
        engine.backward(engine(input_ids=idx, labels=targets).loss)
        engine.step()
        optimizer.zero_grad()
        reference(input_ids=idx, labels=targets).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        optimizer.step()
    state = engine.module_state_dict()
    for key, expected in reference.state_dict().items():
        assert _relative_error(state[key], expected) <= 1e-5, f"{key}: {_relative_error(state[key], expected):.2e}"
    if domino:
        return type(engine.module.model.layers[0]).__name__
    name = type(engine.module.model.layers[0].self_attn.q_proj).__name__
    if not pre_parallelized:
        _after_destroy_no_scope_hooks_and_still_exact(engine, reference)
    return name


def _after_destroy_no_scope_hooks_and_still_exact(engine, reference):
    """destroy() takes the shared-input scopes' hooks off the user's attention and MLP modules; the
    column layers then reduce their input gradients for themselves: the same gradient."""
    engine.destroy()
    model = engine.module
    for layer in model.model.layers:
        for module in (layer.self_attn, layer.mlp):
            assert not module._forward_pre_hooks and not module._forward_hooks, type(module).__name__
        assert layer.self_attn.q_proj.shared_input is None
    idx, targets = _batch(7, 4)
    embeds = reference.model.embed_tokens(idx).detach()
    grads = []
    for net in (model, reference):
        x = embeds.clone().requires_grad_(True)
        with comm.trace() as backward:
            net(inputs_embeds=x, labels=targets).loss.backward()
        grads.append((x.grad, sum(1 for r in backward.records if r.op == "all_reduce" and r.numel == embeds.numel())))
    assert _relative_error(grads[0][0], grads[1][0]) <= 1e-5
    # forward: the 2 row layers of each of the 2 blocks; backward: one input-gradient reduction per
    # column layer now (q, k, v, gate, up in each block), and the LM head's gathered input (with the
    # scopes it was 2 per block + 1: test_tp_shared_input)
    assert grads[0][1] == 2 * 2 + 2 * 5 + 1, grads[0][1]


@pytest.mark.parametrize("pre_parallelized", [False, True])
def test_hugging_face_llama_through_initialize(pre_parallelized):
    from tests.harness import run_distributed

    assert run_distributed(_llama_through_initialize, 2, pre_parallelized, timeout=240) == ["ColumnParallelLinear"] * 2


def test_hugging_face_llama_with_domino_from_the_json_config():
    from tests.harness import run_distributed

    domino = {"chunks": 2, "overlap": "inter"}
    assert run_distributed(_llama_through_initialize, 2, False, domino, timeout=240) == ["DominoLlamaDecoderLayer"] * 2


def _layer_specs_domino(stage):
    from tests.tensor_parallel import llama_like

    config = _config(stage, tensor=2, domino={"chunks": 2, "overlap": "intra"})
    config["tensor_parallel"]["partition_config"] = {"layer_specs": llama_like.LAYER_SPECS}
    torch.manual_seed(0)
    engine, _, _, _ = zerodist.initialize(model=llama_like.LlamaLike(), config=config)
    idx, targets = _batch(0, MICRO)
    engine.backward(engine(idx, targets))
    engine.step()
    return type(engine.module.blocks[0]).__name__


@distributed_test(world_size=2)
def test_layer_specs_model_with_domino_from_the_json_config_at_zero_1_and_3():
    assert _layer_specs_domino(1) == "DominoDecoderLayer"  # the model's own block class, run in turns
    assert _layer_specs_domino(3) == "DominoDecoderLayer"  # [Note: Domino at ZeRO-3] in tensor_parallel/layers.py


def _hf_megatron_sequence_parallel(kind, stage):
    """A Hugging Face model with Megatron's sequence parallelism through initialize() (the plan is
    chosen and applied by the engine), 3 SGD steps against one process."""
    import copy

    from tests.hf_models import hf_batch, hf_class, hf_config, hf_loss

    torch.manual_seed(0)
    reference = hf_class(kind)(hf_config(kind))
    model = copy.deepcopy(reference)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "steps_per_print": 10**9, "tensor_parallel": {"autotp_size": 2},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "zerodist": {"tensor_parallel": {"sequence_parallel": True}}}
    engine, _, _, _ = zerodist.initialize(model=model, config=config)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        ids = hf_batch(step, 2)
        engine.backward(hf_loss(engine, ids))
        engine.step()
        optimizer.zero_grad()
        hf_loss(reference, ids).backward()
        optimizer.step()
    state = engine.module_state_dict()
    engine.destroy()
    for key, expected in reference.state_dict().items():
        if key in state:  # GPT-2's causal-mask buffers are not parameters
            assert _relative_error(state[key], expected) <= 1e-5, f"{key}: {_relative_error(state[key], expected):.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("kind,stage", [("llama", 3), ("gpt2", 1)])
def test_hugging_face_megatron_sequence_parallel_through_initialize(kind, stage):
    from tests.harness import run_distributed

    run_distributed(_hf_megatron_sequence_parallel, 2, kind, stage, timeout=240)
