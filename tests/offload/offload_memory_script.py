"""Peak memory of one training run, in-memory or with `offload_optimizer: nvme`, optionally under a
cap on each rank's address space (RLIMIT_AS) set right after `initialize()`.

    python -m zerodist run --nproc 2 tests/offload/offload_memory_script.py MODE NVME_PATH OUT CAP_BYTES

MODE is "memory" or "nvme" (stage 2), or "nvme3" (stage 3, offload_optimizer nvme) or "param"
(stage 3, offload_optimizer and offload_param nvme); CAP_BYTES 0 sets no cap. The model is the
29M-parameter MLP of the parity test (256 -> 3750 -> 3750 -> 3751 -> 16), sub_group_size 5e5.
Each rank writes OUT.rank<r>.json: its peak RSS (VmHWM), its peak RSS while training (VmHWM
reset after initialize(), which builds the full model first), its largest RSS between steps
(what stays resident: less dependent on how transient buffers happen to overlap), its address space when the cap was
set and at its peak (VmPeak), the trained steps, the error if an allocation failed under the cap, and
the engine's own byte counts: parameters and optimizer state held in memory, optimizer state in the
swap files. Tests assert on the byte counts (exact); the RSS figures are for
benchmarks/offload_memory_bench.py (RSS on a shared machine moves by more than the differences).
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch
import torch.nn.functional as F

STEPS, MICRO = 3, 4


def status() -> dict[str, int]:
    with open("/proc/self/status", encoding="utf-8") as file:
        fields = dict(line.split(":", 1) for line in file if line.startswith("Vm"))
    return {key: int(value.split()[0]) * 1024 for key, value in fields.items()}


def main(argv: list[str] | None = None) -> None:
    """`argv`: MODE NVME_PATH OUT CAP_BYTES (the command line's, by default)."""
    import zerodist
    from zerodist.models import make_mlp

    mode, nvme_path, out, cap_text = sys.argv[1:5] if argv is None else argv
    cap = int(cap_text)
    torch.set_num_threads(1)
    zero: dict = {"stage": 3 if mode in ("nvme3", "param") else 2, "sub_group_size": 500_000}
    if mode != "memory":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pipeline_read": True,
                                     "pipeline_write": True, "buffer_count": 4}
    if mode == "param":
        zero["offload_param"] = {"device": "nvme"}
    units = {}
    if zero["stage"] == 3:  # a unit per layer, gathered one at a time: a gather reads one layer's shard
        zero["stage3_prefetch_bucket_size"] = 0
        units = {"zerodist": {"stage3_unit_classes": ["Linear"]}}
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero, **units}
    engine = zerodist.initialize(model=make_mlp(256, 3750, 16, layers=4, seed=0), config=config)[0]
    rank = engine.global_rank
    report: dict = {"at_cap": status()["VmSize"], "steps": 0, "error": None, "init_peak_rss": status()["VmHWM"]}
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as file:
        file.write("5")  # VmHWM := VmRSS: the peak while training, from here
    if cap:
        resource.setrlimit(resource.RLIMIT_AS, (report["at_cap"] + cap, resource.RLIM_INFINITY))
    try:
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(step * 10 + rank)
            x, y = torch.randn(MICRO, 256, generator=generator), torch.randn(MICRO, 16, generator=generator)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
            report["steps"] += 1
            report["step_rss"] = max(report.get("step_rss", 0), status()["VmRSS"])
    except (RuntimeError, MemoryError) as error:  # torch: "DefaultCPUAllocator: can't allocate memory"
        report["error"] = str(error)[:300]
    report.update(peak_rss=max(status()["VmHWM"], report["init_peak_rss"]), train_peak_rss=status()["VmHWM"],
                  peak_vm=status()["VmPeak"], param_bytes=engine.model_state_bytes()["params"],
                  optimizer_bytes=engine.model_state_bytes()["optimizer"],
                  swapped_bytes=getattr(engine.zero_state.inner_optimizer, "swapped_state_bytes", lambda: 0)())
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as file:
        json.dump(report, file)
    if report["error"]:
        os._exit(1)  # the other rank waits in a collective: the launcher stops the group
    engine.destroy()


if __name__ == "__main__":
    main()
