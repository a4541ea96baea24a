"""The training step of each framework train_bench.py measures: zerodist, DDP, FSDP2 and DeepSpeed,
each training the same GPT with the same AdamW, clipping and 25 MiB gradient buckets.

A trainer is built as `TRAINERS[framework](model, run, size)` from a `train_bench.Run` (framework,
stage, zerodist's switches) and a `train_bench.Size` (the micro-batch)."""

from __future__ import annotations

from typing import Any

BUCKET_MB = 25
BUCKET_ELEMENTS = BUCKET_MB * 1024 * 1024 // 4  # fp32 elements in DDP's bucket_cap_mb
WORLD_SIZE = 2
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
CLIP = 1.0


def storage_bytes(*roots: Any) -> int:
    """Bytes of the distinct tensor storages in `roots` (tensors, their .grad, nested containers)."""
    import torch

    seen: set[int] = set()
    total = 0
    stack = list(roots)
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item  # DTensor: this rank's shard
            storage = local.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
            if item.grad is not None:
                stack.append(item.grad)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


class Trainer:
    """One framework's training step, split where the memory breakdown samples the forward:
    `step()` is `finish(forward())`. `model` is the user's module (its parameters may be re-pointed
    by the framework)."""

    model: Any

    def step(self, inputs: Any, targets: Any) -> float:
        return self.finish(self.forward(inputs, targets))

    def forward(self, inputs: Any, targets: Any) -> Any:
        raise NotImplementedError

    def finish(self, loss: Any) -> float:
        raise NotImplementedError

    def trace(self) -> Any:
        """zerodist's tracer over the timed steps; None for the others."""
        return None

    def blocked_meter(self) -> Any:
        """zerodist's blocked-time meter over one step; None for the others."""
        return None


class EngineTrainer(Trainer):
    """zerodist's and DeepSpeed's engines share one training-step API."""

    engine: Any

    def forward(self, inputs: Any, targets: Any) -> Any:
        return self.engine(inputs, targets)

    def finish(self, loss: Any) -> float:
        self.engine.backward(loss)
        self.engine.step()
        return float(loss)


class ZerodistTrainer(EngineTrainer):
    def __init__(self, model: Any, run: Any, size: Any):
        import zerodist

        config = {
            "train_micro_batch_size_per_gpu": size.micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
            "gradient_clipping": CLIP, "steps_per_print": 10**6,
            "zero_optimization": {"stage": run.stage, "reduce_scatter": run.reduce_scatter,
                                  "overlap_comm": run.overlap,
                                  "reduce_bucket_size": BUCKET_ELEMENTS, "allgather_bucket_size": BUCKET_ELEMENTS,
                                  **run.stage3_options},
        }
        self.model = model
        self.engine, _, _, _ = zerodist.initialize(model=model, config=config)

    def state_bytes(self) -> int:
        return self.engine.model_state_bytes()["total"]

    def trace(self) -> Any:
        import zerodist.comm as comm

        return comm.trace()

    def blocked_meter(self) -> Any:
        import zerodist.comm as comm

        return comm.measure_blocked()


class DDPTrainer(Trainer):
    def __init__(self, model: Any, run: Any, size: Any):
        import torch

        self.model = model
        self.ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        self.optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)

    def forward(self, inputs: Any, targets: Any) -> Any:
        self.optimizer.zero_grad(set_to_none=True)
        return self.ddp(inputs, targets)

    def finish(self, loss: Any) -> float:
        import torch

        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        return float(loss)

    def state_bytes(self) -> int:
        return storage_bytes(list(self.model.parameters()), self.optimizer.state)


class FSDP2Trainer(DDPTrainer):
    def __init__(self, model: Any, run: Any, size: Any):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = self.ddp = model
        self.optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)


class DeepSpeedTrainer(EngineTrainer):
    def __init__(self, model: Any, run: Any, size: Any):
        import deepspeed
        import torch

        deepspeed.init_distributed(dist_backend="gloo")
        config = {
            "train_micro_batch_size_per_gpu": size.micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP, "steps_per_print": 10**6, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": run.stage, "reduce_bucket_size": BUCKET_ELEMENTS,
                                  "allgather_bucket_size": BUCKET_ELEMENTS, **run.stage3_options},
        }
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        self.model = model
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def state_bytes(self) -> int:
        """Parameters, gradients, the optimizer's state and every tensor the ZeRO wrapper holds
        directly (flat buffers, fp32 partitions, reduce buckets)."""
        wrapper = self.optimizer
        inner = getattr(wrapper, "optimizer", wrapper)
        held = [v for v in vars(wrapper).values() if _is_tensor_container(v)] if inner is not wrapper else []
        return storage_bytes(list(self.model.parameters()), inner.state, held)


def _is_tensor_container(value: Any) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, (list, tuple)) and any(_is_tensor_container(v) for v in value[:4])


TRAINERS = {"zerodist": ZerodistTrainer, "ddp": DDPTrainer, "deepspeed": DeepSpeedTrainer, "fsdp2": FSDP2Trainer}
