"""DeepSpeed's manual sequence parallelism ([Note: DeepSpeed's manual sequence parallelism] in
zerodist/engine/deepspeed_args.py): `initialize(mesh_param=(dp, sp))`, `initialize(mpu=parallel_state_sp)`
and a config with `data_parallel_size` + `sequence_parallel_size` make the engine's sequence groups
(DeepSpeed's mesh order) and nothing else; DeepSpeed's 5-argument `_SeqAllToAll` with heads the
degree does not divide, against the whole tensor on one process; the gradients of a manual run
against one process."""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.harness import distributed_test
from zerodist.runtime import groups
from zerodist.runtime.sequence_parallel import parallel_state_sp
from zerodist.sequence.errors import SequenceParallelError
from zerodist.sequence.head_exchange import shard_sizes
from zerodist.sequence.layer import _SeqAllToAll

SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


@pytest.mark.unit
def test_heads_are_dealt_by_deepspeeds_rule():
    from zerodist.runtime.module_inject.tp_shard import get_shard_size_list

    for heads, degree in [(3, 2), (7, 2), (7, 4), (8, 4), (16, 3)]:
        assert shard_sizes(heads, degree) == get_shard_size_list(heads, degree, num_kv_heads=heads)
    assert shard_sizes(16, 3, num_kv_heads=8) == [6, 6, 4]  # whole key/value groups (GQA)
    with pytest.raises(SequenceParallelError, match="whole group"):
        shard_sizes(1, 2)


@distributed_test(world_size=4)
def test_mesh_param_makes_deepspeeds_groups_and_nothing_else():
    engine, _, _, _ = zerodist.initialize(model=_mlp(), config={"train_batch_size": 8, **SGD}, mesh_param=(2, 2))
    rank = comm.get_rank()
    assert engine.sequence_parallel_size == 2 and engine.dp_world_size == 2 and engine.mp_world_size == 1
    assert comm.get_world_size(engine.seq_parallel_group) == 2 and comm.get_world_size(engine.data_parallel_group) == 2
    # DeepSpeed's mesh (data, sequence): consecutive ranks share a sequence group
    assert groups._get_sequence_parallel_rank() == rank % 2 and groups._get_data_parallel_rank() == rank // 2
    assert groups._get_sequence_parallel_world_size() == 2 and engine.train_micro_batch_size_per_gpu() == 4
    assert engine.seq_dp_world_size == 4 and engine.checkpoint_mp_rank == 0
    # the model is the user's, unwired: a plain forward of this rank's own rows
    x = torch.randn(4, 4)
    assert torch.equal(engine(x), engine.module(x))


@distributed_test(world_size=2)
def test_mpu_and_config_mesh_and_refusals():
    parallel_state_sp._release_sequence_parallel_groups()
    parallel_state_sp.initialize_sequence_parallel(2)
    assert parallel_state_sp.get_model_parallel_rank() == comm.get_rank()
    assert parallel_state_sp.get_sequence_data_parallel_world_size() == 2
    engine, _, _, _ = zerodist.initialize(model=_mlp(), config={"train_batch_size": 2, **SGD}, mpu=parallel_state_sp)
    assert engine.sequence_parallel_size == 2 and engine.dp_world_size == 1 and engine.mp_world_size == 1
    parallel_state_sp._release_sequence_parallel_groups()
    engine, _, _, _ = zerodist.initialize(model=_mlp(), config={
        "train_batch_size": 2, "data_parallel_size": 1, "sequence_parallel_size": 2, **SGD})
    assert engine.sequence_parallel_size == 2 and groups._get_sequence_parallel_world_size() == 2
    with pytest.raises(ValueError, match="data 2 x sequence 2 = 4 ranks, but the world has 2"):
        zerodist.initialize(model=_mlp(), config={"train_batch_size": 2, **SGD}, mesh_param=(2, 2))
    with pytest.raises(ValueError, match="without 'sequence_parallel_size'"):
        zerodist.initialize(model=_mlp(), config={"train_batch_size": 2, "data_parallel_size": 2, **SGD})

    class MegatronUnit:
        def get_model_parallel_world_size(self) -> int:
            return 1

    with pytest.raises(ValueError, match="takes no model-parallel unit"):
        zerodist.initialize(model=_mlp(), config={"train_batch_size": 2, **SGD}, mpu=MegatronUnit())


def _whole(batch: int, seq: int, heads: int, head_dim: int, batch_dim: int) -> torch.Tensor:
    torch.manual_seed(1)
    whole = torch.randn(batch, seq, heads, head_dim)
    return whole if batch_dim == 0 else whole.transpose(0, 1).contiguous()


@distributed_test(world_size=2)
@pytest.mark.parametrize("heads", [3, 4])
@pytest.mark.parametrize("batch_dim", [0, 1])
def test_deepspeed_all_to_all_matches_the_whole_tensor(heads, batch_dim):
    group, rank = comm.get_world_group(), comm.get_rank()
    seq_dim, degree = 1 - batch_dim, 2
    whole = _whole(2, 6, heads, 3, batch_dim)
    local = whole.chunk(degree, dim=seq_dim)[rank].clone().requires_grad_(True)
    sizes = shard_sizes(heads, degree)
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    s2h = _SeqAllToAll.apply(group, local, 2, seq_dim, batch_dim)
    assert torch.equal(s2h, whole[:, :, mine])  # the whole sequence for this rank's heads
    h2s = _SeqAllToAll.apply(group, s2h, seq_dim, 2, batch_dim)
    assert torch.equal(h2s, local)
    weights = torch.arange(h2s.numel(), dtype=torch.float32).view_as(h2s)
    (h2s * weights).sum().backward()
    assert torch.equal(local.grad, weights)  # the round trip's gradient is the identity's
    with pytest.raises(SequenceParallelError, match="different shapes"):  # on every rank, before the exchange
        _SeqAllToAll.apply(group, torch.zeros(2, 3 + rank, heads, 3), 2, 1, 0)


@distributed_test(world_size=2)
def test_manual_run_sums_over_sequence_and_matches_one_process():
    """Each sequence rank computes the loss of its half of the tokens, weighted by the whole count
    (DeepSpeed's manual pattern); ZeRO sums over sequence and divides by the data degree (1), so
    the parameters equal one process training on every token."""
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 2}, **SGD}
    engine, _, _, _ = zerodist.initialize(model=_mlp(), config=config, mesh_param=(1, 2))
    reference = _mlp()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    rank = comm.get_rank()
    for step in range(3):
        torch.manual_seed(10 + step)
        tokens, targets = torch.randn(8, 4), torch.randn(8, 1)
        mine = slice(4 * rank, 4 * rank + 4)
        loss = ((engine(tokens[mine]) - targets[mine]) ** 2).sum() / 8
        engine.backward(loss)
        engine.step()
        optimizer.zero_grad()
        (((reference(tokens) - targets) ** 2).sum() / 8).backward()
        optimizer.step()
    state = engine.module_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6)


@distributed_test(world_size=2)
def test_manual_mode_leaves_a_pipelines_micro_batches_whole():
    """DeepSpeed's PipelineEngine never sees the mesh: under mesh_param a pipeline's micro-batch is
    the script's own slice, not sliced again (it was cut from (2, 16) to (2, 8))."""
    from zerodist.models import GPT, gpt_config
    from zerodist.pipe import split_model

    torch.manual_seed(0)
    model = split_model(GPT(gpt_config("tiny")), num_stages=1)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, **SGD}
    engine = zerodist.initialize(model=model, config=config, mesh_param=(1, 2))[0]
    sequence = engine.part_states["sequence"]
    assert sequence.settings.method == "manual"
    x = torch.randint(0, 10, (2, 16))
    inputs, labels = sequence.local_micro_batch(x, x)
    assert inputs is x and labels is x
    engine.destroy()


@distributed_test(world_size=2)
def test_all_to_all_refuses_a_many_dimension_tensor_on_every_rank_and_counts_its_gradients():
    """One rank's 9-D tensor is refused on both ranks after the shape gather (refused before it,
    the other rank hung in the gather); the 4-argument form called with a fifth None has a backward."""
    group, rank = comm.get_world_group(), comm.get_rank()
    tensor = torch.zeros(*([1] * 9)) if rank == 0 else torch.zeros(2, 4, 2, 3)
    with pytest.raises(SequenceParallelError, match=r"\[9, 4\] dimensions"):
        _SeqAllToAll.apply(group, tensor, 2, 1, 0)
    x = torch.randn(1, 4, 4, 2, requires_grad=True)
    _SeqAllToAll.apply(group, x, 2, 1, None).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@distributed_test(world_size=2)
def test_a_later_plain_engine_leaves_deepspeeds_groups_alone():
    """DeepSpeed sets its process-wide groups only for an engine with a mesh or mpu: a plain engine
    built after a sequence-parallel one (TRL's reference model) leaves them answering the sequence
    group; the sequence engine's destroy() hands them back to the world."""
    engine = zerodist.initialize(model=_mlp(), config={"train_batch_size": 2, **SGD}, mesh_param=(1, 2))[0]
    plain = zerodist.initialize(model=_mlp(), config={"train_batch_size": 2})[0]
    assert groups._get_sequence_parallel_world_size() == 2 and groups._get_data_parallel_world_size() == 1
    assert comm.get_world_size(groups._get_sequence_parallel_group()) == 2
    plain.destroy()
    assert groups._get_sequence_parallel_world_size() == 2
    engine.destroy()
    assert groups._get_sequence_parallel_world_size() == 1 and groups._get_data_parallel_world_size() == 2
