"""A Hugging Face model built through transformers' own ZeRO-3 path (`HfDeepSpeedConfig` makes
`is_deepspeed_zero3_enabled()` true, so `from_config` / `from_pretrained` enter the served
`deepspeed.zero.Init` and initialise and load through `GatheredParameters(modifier_rank=0)`), against
the same path with `Init` building eagerly. Run by tests/zero/test_zero_init_hf.py under
`zerodist run --as-deepspeed --nproc 2`; each rank writes what it measured to `<out>/rank<r>.json`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.hf_models import SEQ, VOCAB, hf_config  # noqa: E402

DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def build(kind: str, partitioned: bool, path: str | None = None) -> torch.nn.Module:
    import deepspeed
    import transformers

    import zerodist.runtime.zero.served as served

    served_init = deepspeed.zero.Init
    if not partitioned:  # the reference: the same transformers path, Init building eagerly
        deepspeed.zero.Init = lambda *a, **k: served.Init(*a, enabled=False, **k)
    try:
        torch.manual_seed(0)
        if path is not None:
            return transformers.AutoModelForCausalLM.from_pretrained(path)
        return transformers.AutoModelForCausalLM.from_config(hf_config(kind))
    finally:
        deepspeed.zero.Init = served_init


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(model: torch.nn.Module, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    import deepspeed

    import zerodist.comm as comm

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)
    n, rank = comm.get_world_size(), comm.get_rank()
    losses = []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (2 * n, SEQ), generator=torch.Generator().manual_seed(step))[2 * rank: 2 * rank + 2]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.module_state_dict()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def trainer(out: str, kind: str, partitioned: bool) -> None:
    """`TrainingArguments(deepspeed=<LLaMA-Factory's ds_z3 template>)`, the model from `from_config`
    after it (so under the served Init, or with `partitioned` off eagerly), trained by `Trainer`."""
    import transformers

    import zerodist.comm as comm
    from zerodist.zero import init_shards

    template = Path(__file__).resolve().parents[1] / "config" / "templates" / "llamafactory_ds_z3_config.json"
    settings = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                    max_grad_norm=1.0, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                    disable_tqdm=True, deepspeed=str(template), ddp_backend="gloo")
    args = transformers.TrainingArguments(**settings)
    model = build(kind, partitioned)
    held = init_shards.partitioned_bytes(model)
    ids = torch.randint(0, VOCAB, (48, SEQ), generator=torch.Generator().manual_seed(1))
    run = transformers.Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])
    run.train()
    losses = [h["loss"] for h in run.state.log_history if "loss" in h]
    Path(out, f"trainer{comm.get_rank()}.json").write_text(json.dumps({"losses": losses, "held_bytes": held}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--kind", default="llama")
    parser.add_argument("--trainer", choices=["partitioned", "eager"], default=None)
    args = parser.parse_args()
    if args.trainer is not None:
        trainer(args.out, args.kind, args.trainer == "partitioned")
        return
    import transformers
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    import zerodist.comm as comm
    from zerodist.zero import init_shards, is_sharded

    transformers.logging.set_verbosity_error()
    keep = HfDeepSpeedConfig(DS_CONFIG)  # noqa: F841  (transformers holds it weakly)
    assert is_deepspeed_zero3_enabled()
    model = build(args.kind, partitioned=True)
    eager = build(args.kind, partitioned=False)
    full_bytes = sum(p.numel() * p.element_size() for p in eager.parameters())
    result = {"rank": comm.get_rank(), "world": comm.get_world_size(), "full_bytes": full_bytes,
              "held_bytes": init_shards.partitioned_bytes(model),
              "all_sharded": all(is_sharded(p) for p in model.parameters()),
              "eager_sharded": any(is_sharded(p) for p in eager.parameters()),
              "tied": [m.get_output_embeddings().weight is m.get_input_embeddings().weight for m in (model, eager)]}
    eager_values = {n: p.detach().clone() for n, p in eager.named_parameters()}
    result["init_diff"] = max_diff(full_state(model), eager_values)
    saved = Path(args.out, "saved")
    if comm.get_rank() == 0:
        eager.save_pretrained(saved)
    comm.barrier()
    loaded = build(args.kind, partitioned=True, path=str(saved))
    result["loaded_held_bytes"] = init_shards.partitioned_bytes(loaded)
    result["loaded_diff"] = max_diff(full_state(loaded), eager_values)
    del loaded
    result["losses"], state = train(model)
    result["eager_losses"], eager_state = train(eager)
    result["train_diff"] = max_diff(state, eager_state)
    Path(args.out, f"rank{comm.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
