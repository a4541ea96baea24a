"""Issue 31's pairs with the expert axis that had no test of their own: expert x sequence and
expert x tensor, on the demo MoE GPT (the only model with MoE layers; Hugging Face Llama has none),
4 gloo ranks, ZeRO 1 and 3, 5 SGD steps: parameters (experts under their global ids) within 1e-6
of the model with every expert in one process on the same global batch, and each axis' bytes equal
their formulas. The balance loss has weight 0 and the capacity is every token of the call
(`capacity_factor` = the number of experts), so no token is dropped on a rank or in one process
(capacity and the balance loss are statistics of a rank's own tokens, as in DeepSpeed:
tests/pipe/test_pipe_expert.py), and the MoE layer's all-to-alls have the fixed capacity-mode size:
4 per layer per micro-batch (dispatch and combine, forward and backward) of E x C x hidden.

- expert 2 x sequence 2: the batch is dealt over the expert ranks (each reads other samples), each
  sequence rank keeps its slice; the MoE layer routes the rank's own tokens over the expert group;
  Ulysses' all-to-alls are those of every attention layer (`ulysses_bytes`), the MoE layer's
  capacity is that of the slice's tokens.
- expert 2 x tensor 2: the dense blocks' MLP and the head tensor-parallel, the experts replicated
  over the tensor axis (each tensor rank routes the same tokens); the tensor axis' bytes: the
  dense MLP's row-parallel all-reduce and the gathered logits forward, the MLP's and the head's
  input-gradient all-reduces backward (the schedule log).
"""

from __future__ import annotations

import pytest
import torch

import zerodist
import zerodist.comm as comm
from tests.compose.parity import assert_states_match
from tests.harness import run_distributed
from zerodist.models import GPTConfig
from zerodist.models.moe_gpt import MoEConfig, MoEGPT
from zerodist.sequence import SequenceLayout
from zerodist.sequence.data import shard_batch
from zerodist.sequence.layout import ulysses_bytes
from zerodist.tensor_parallel import schedule_log

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

VOCAB, SEQ, HIDDEN, HEADS, LAYERS, MICRO, STEPS, LR = 32, 8, 16, 2, 2, 2, 5, 0.1
SHARDS = 2  # the expert ranks: each reads its own micro-batch
EXPERTS = 2


def build(ep_size: int) -> MoEGPT:
    torch.manual_seed(0)
    return MoEGPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
                            d_ff=32, dropout=0.0),
                  MoEConfig(num_experts=EXPERTS, ep_size=ep_size, drop_tokens=True, capacity_factor=float(EXPERTS),
                            min_capacity=0, aux_loss_coef=0.0, moe_every=2))


def samples(step: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(700 + 10 * step + shard)
    return (torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator),
            torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator))


def reference_body() -> list[dict[str, torch.Tensor]]:
    """One process, every expert: each shard's token-mean loss, averaged over the shards."""
    model = build(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    states = []
    for step in range(STEPS):
        optimizer.zero_grad()
        (sum(model(*samples(step, s)) for s in range(SHARDS)) / SHARDS).backward()
        optimizer.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


# the dense block's MLP and the head tensor-parallel, the MoE block's experts replicated over the tensor
# axis, the attention whole (its reshape uses the global head count)
TENSOR_SPECS = {"layer_specs": [
    {"patterns": [r"^blocks\.0\.mlp\.fc_in\.weight$"], "partition_type": "column"},
    {"patterns": [r"^blocks\.0\.mlp\.fc_out\.weight$"], "partition_type": "row"},
    {"patterns": [r"^lm_head\.weight$"], "partition_type": "column", "gather_output": True},
]}


def settings(stage: int, axis: str) -> dict:
    config: dict = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
                    "optimizer": {"type": "SGD", "params": {"lr": LR}}, "steps_per_print": 10**9,
                    "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if axis == "sequence":
        config["sequence_parallel_size"] = 2
    elif axis == "tensor":
        config["tensor_parallel"] = {"autotp_size": 2, "partition_config": TENSOR_SPECS}
    else:  # "built-in plan": no partition_config, so the engine picks moe_gpt_plan (apply.py's choose_plan)
        config["tensor_parallel"] = {"autotp_size": 2}
    return config


def pair_body(stage: int, axis: str):
    engine = zerodist.initialize(model=build(2), config=settings(stage, axis))[0]
    degrees = dict(engine.topology.degrees)
    assert degrees == {"pipe": 1, "data": 1, "expert": 2, "sequence": 2 if axis == "sequence" else 1,
                       "tensor": 1 if axis == "sequence" else 2}, degrees
    if axis == "built-in plan":  # attention head-parallel: moe_gpt_plan, not the layer_specs
        assert type(engine.module.blocks[0].attn).__name__ == "HeadParallelAttention"
    shard = engine.topology.batch_rank
    layout = SequenceLayout(engine.topology.axis_rank("sequence"), 2) if axis == "sequence" else None
    states, traces = [], []
    for step in range(STEPS):
        batch = samples(step, shard)
        with schedule_log() as log, comm.trace() as trace:
            loss = engine(*(shard_batch(batch, layout) if layout else batch))
            engine.backward(loss)
            engine.step()
        traces.append((trace.bus_bytes("all_to_all"), log.all_bytes("forward"), log.all_bytes("backward")))
        states.append(engine.module_state_dict())
    engine.destroy()
    return states, traces


def expected_bytes(axis: str) -> tuple[float, int, int]:
    """(all-to-all bus bytes, tensor forward bytes, tensor backward bytes) of one step on a rank."""
    tokens = MICRO * SEQ // (2 if axis == "sequence" else 1)  # this rank's tokens: C = E x tokens / E
    moe = 4 * EXPERTS * tokens * HIDDEN * 4 / 2  # bus factor (P-1)/P of the expert group of 2
    if axis == "sequence":  # every attention layer, forward and backward
        one = ulysses_bytes(batch=MICRO, seq=SEQ, heads=HEADS, kv_heads=HEADS, head_dim=HIDDEN // HEADS, degree=2,
                            element_size=4)
        return moe + 2 * LAYERS * one, 0, 0
    activation = 4 * tokens * HIDDEN
    return moe, activation + 4 * tokens * VOCAB, 2 * activation


def check(stage: int, axis: str) -> None:
    (reference,), = [run_distributed(reference_body, 1)]
    results = run_distributed(pair_body, 4, stage, axis, timeout=300)
    for _, traces in results:
        assert all(trace == expected_bytes(axis) for trace in traces), (traces, expected_bytes(axis))
    assert_states_match((states for states, _ in results), reference, axis)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("axis", ["sequence", "tensor"])
def test_expert2_by_other_axis_equals_one_process(axis, stage):
    check(stage, axis)


@pytest.mark.parametrize("stage", [1, 3])
def test_expert2_by_tensor2_with_the_built_in_moe_gpt_plan_equals_one_process(stage):
    """The engine's own plan for the demo MoE GPT (moe_gpt_plan through choose_plan: attention
    head-parallel, the dense MLP and the head tensor-parallel, the experts replicated over tensor), no
    partition_config and no Domino: parameters within 1e-6 of one process."""
    (reference,), = [run_distributed(reference_body, 1)]
    results = run_distributed(pair_body, 4, stage, "built-in plan", timeout=300)
    assert_states_match((states for states, _ in results), reference, ("built-in plan", stage))
