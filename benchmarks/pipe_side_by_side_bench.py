"""zerodist's pipeline schedules side by side with torch.distributed.pipelining's and with "local",
in one pair of gloo processes, on a real model (a GPT in 2 stages, AdamW).

    python benchmarks/pipe_side_by_side_bench.py [--micro-batches 8 16] [--shapes 4x128] [--d-model 512]
                                                 [--layers 8] [--rounds 5] [--arms zbv local]
                                                 [--heap default|keep|both] [--baseline]

Each (micro-batches, shape) configuration runs in the same process pair, one after the other; an
activation message is batch x seq x d_model fp32 (4x128x512: 1 MiB, over gloo's 256 KiB eager
size and far over the header's 4 KiB inline area, so every message is a header plus a payload).
`--arms` keeps the arms whose name contains one of the words (local and local-v always run).

Arms (each runs one training step per round, rounds interleaved, each round starting one arm
later than the one before so that no arm always inherits the same predecessor's heap and caches;
the median reported, and "best", the arm's fastest round over local's fastest):
- zerodist: `PipelineExecutor` on `build_schedule(name)` for 1f1b, gpipe, interleaved (2 stages per
  rank), zb (ZB-H1), zbv and dualpipev (2 stages per rank in a V), then each rank's AdamW step over its stage (no data parallelism, so no
  reduction: the engine adds nothing a pipe-only run needs);
- torch: `PipelineStage` + Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble (one stage
  per rank: ZB-H1), ScheduleZBVZeroBubble and ScheduleDualPipeV (2 stages per rank in a V) over the
  same layer objects;
- local: each rank runs its own stage's forwards and backwards on the same micro-batches (the
  first stage from fixed output gradients, the last from a fixed input) and its AdamW step, with no
  message: the limit a pipeline approaches as its bubble and messages vanish;
- local-v: the same for the rank's two stages of the V (ZB-V's and DualPipeV's limit: their
  ranks hold other layers than the one-stage-per-rank split, see below).
Every module is cut with partition_method="parameters" (DeepSpeed's default): the GPT's embedding
and head are cheap, so "uniform" would give the V's rank 1 five blocks against rank 0's three
(stages of 3, 3, 2, 2 layers; rank 0 holds the first and the last), a 1.24x longer step on rank 1
that is the cut, not the schedule (it was the whole of ZB-V's and DualPipeV's 1.26-1.28x "over
ideal" in the first runs).
Every arm starts from the same weights and optimizer state; the pipeline arms must end at the same
loss (checked to 6 digits: they compute the same sums, in different orders). Each figure is the
arm's step time over local's, and over its ideal base x (1 + bubble), base being local-v for the
V arms and local for the others, with bubble (p-1)/m for
GPipe and 1F1B, (p-1)/(v m) interleaved, (p-1)/(3m) ZB-H1 (T_F = T_I = T_W, Qi et al. 2024),
(p-1)/(6m) ZB-V and DualPipeV (the V's fill, [Note: V schedules] in zerodist/pipe/schedule.py).
"cpu x local" is the busier rank's CPU time (time.process_time, so waiting is excluded) over
local's: it reads about the same on a loaded machine, and says how much of an arm's excess is work
it adds (copies, the split backward's graph walk, an unbalanced cut) rather than idle. "sys ms"
and "faults" are the busier rank's kernel CPU time and minor page faults per step (getrusage):
memory an arm holds longer (GPipe's m activations, zero-bubble's deferred W) is memory the
allocator gets fresh from the kernel, zeroed page by page, where local reuses its own.
`--heap keep` (or `--keep-heap`) runs the ranks with glibc told to keep what is freed (every arm
alike): GPipe's excess CPU over 1F1B went from 3.5% to 0.4% with it (benchmarks/README.md);
`--heap both` runs one process pair each way, glibc's defaults first, each table headed by which.
`--baseline` adds a "-base" arm per zerodist schedule: the executor with every receive allocating
and every I and W run apart (`reuse_buffers=False, fuse_backward=False`), to read the receive pool
and the fused I + W against, in the same rounds.
- deepspeed: DeepSpeed's `PipelineEngine` (`TrainSchedule`, 1F1B) over the same layer objects, cut
  by DeepSpeed's own `partition_method="parameters"` (checked equal to zerodist's cut), one engine
  per configuration, its `train_batch` over the same micro-batches, the same AdamW passed in as the
  client optimizer (state cleared each round). It runs when `import deepspeed` works in the
  interpreter running the benchmark (DS_ACCELERATOR=cpu, on the gloo group already up), and is
  left out with a note otherwise (a python with DeepSpeed 0.19.8 next to this torch: see
  benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import free_port, run_ranks  # noqa: E402

ZD = ["1f1b", "gpipe", "interleaved", "zb", "zbv", "dualpipev"]
TORCH = ["Schedule1F1B", "ScheduleGPipe", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
         "ScheduleDualPipeV"]
V_ARMS = ("zbv", "dualpipev", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
DEEPSPEED = "deepspeed:TrainSchedule"


def deepspeed_missing() -> str | None:
    """Why DeepSpeed's arm cannot run in this interpreter (None when it can)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except Exception as error:  # an ImportError, or DeepSpeed failing at import on this torch
        return f"{type(error).__name__}: {error}"
    return None


def bubble(arm: str, p: int, m: int) -> float:
    if arm.startswith("local"):
        return 0.0
    arm = arm.removesuffix("-base")
    if arm.endswith(V_ARMS):  # [Note: V schedules] in zerodist/pipe/schedule.py: idle (p-1) chunk forwards of 6m chunk actions
        return (p - 1) / (6 * m)
    if arm.endswith("interleaved"):
        return (p - 1) / (2 * m)
    if arm.endswith("zb") or arm.endswith("ZeroBubble"):
        return (p - 1) / (3 * m)
    return (p - 1) / m


def layers_of(args: argparse.Namespace) -> list[torch.nn.Module]:
    from zerodist.models.gpt import Block, GPTConfig
    from zerodist.models.gpt_pipe import Embeddings

    config = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                       n_heads=8)
    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.LayerNorm(config.d_model), torch.nn.Linear(config.d_model, config.vocab_size))
    return [Embeddings(config), *[Block(config) for _ in range(config.n_layers)], head]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Arms:
    """One rank's arms for one configuration, all over the same layer objects, reset to the same
    state before each."""

    def __init__(self, rank: int, args: argparse.Namespace):
        from zerodist.pipe import PipelineExecutor, PipelineModule, build_schedule

        self.rank, self.args, self.m = rank, args, args.micro_batches
        self.layers = layers_of(args)
        self.initial = [copy.deepcopy(layer.state_dict()) for layer in self.layers]
        g = torch.Generator().manual_seed(1)
        self.tokens = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(self.m)]
        self.targets = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(self.m)]
        self.modules = {v: PipelineModule(self.layers, num_stages=2, stages_per_rank=1 if v == 1 else 2,
                                          loss_fn=loss_fn, partition_method="parameters",
                                          stage_placement="v" if v == "v" else "loop") for v in (1, 2, "v")}
        self.executors = {v: PipelineExecutor(module, [0, 1], timeout_s=600) for v, module in self.modules.items()}
        # the "-base" arms: every receive allocates and every I and W run apart (before the pool and the fusion)
        self.base_executors = {v: PipelineExecutor(module, [0, 1], timeout_s=600, reuse_buffers=False,
                                                   fuse_backward=False) for v, module in self.modules.items()}
        self.schedules = {name: build_schedule(name, num_ranks=2, num_microbatches=self.m,
                                               stages_per_rank=1 if name in ("1f1b", "gpipe", "zb") else 2)
                          for name in ZD}
        halves, quarters = self.modules[1].parts, self.modules["v"].parts
        self.mine = self.layers[halves[rank]:halves[rank + 1]]  # this rank's stage at one stage per rank
        self.stage = torch.nn.Sequential(*self.mine)
        # the V: stages rank and 3 - rank, cut as the zerodist V module is
        self.v_stages = {s: torch.nn.Sequential(*self.layers[quarters[s]:quarters[s + 1]]) for s in (rank, 3 - rank)}
        shape = (args.batch, args.seq, args.d_model)
        self.fixed = [torch.randn(shape, generator=g) for _ in range(self.m)]  # local: inputs / output grads
        self.deepspeed = self._deepspeed_engine() if DEEPSPEED in arm_names(args) else None

    def _deepspeed_engine(self):  # type: ignore[no-untyped-def]
        """DeepSpeed's PipelineEngine over this rank's layers of the one-stage-per-rank cut."""
        import deepspeed
        from deepspeed.pipe import PipelineModule as DeepSpeedPipelineModule

        module = DeepSpeedPipelineModule(self.layers, num_stages=2, loss_fn=loss_fn, partition_method="parameters")
        if list(module.parts) != list(self.modules[1].parts):
            raise RuntimeError(f"DeepSpeed cut {list(module.parts)}, zerodist {list(self.modules[1].parts)}")
        config = {"train_micro_batch_size_per_gpu": self.args.batch, "gradient_accumulation_steps": self.m,
                  "train_batch_size": self.args.batch * self.m, "steps_per_print": 10**9,
                  "wall_clock_breakdown": False}
        optimizer = torch.optim.AdamW(list(self.stage.parameters()), lr=1e-4)
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        return engine

    def reset(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        self.reset_layers()
        return torch.optim.AdamW(params, lr=1e-4)

    def reset_layers(self) -> None:
        for layer, state in zip(self.layers, self.initial):
            layer.load_state_dict(state)
            for p in layer.parameters():
                p.grad = None

    def run(self, arm: str) -> float | None:
        """One training step of `arm`; the last stage's mean loss (None on the first)."""
        kind, _, name = arm.partition(":")
        if kind == "zerodist":
            name, base = name.removesuffix("-base"), name.endswith("-base")
            v: int | str = 2 if name == "interleaved" else "v" if name in V_ARMS else 1
            module = self.modules[v]
            params = [p for s in module.local_stages for layer in module.stage_modules(s) for p in layer.parameters()]
            optimizer = self.reset(params)
            result = (self.base_executors if base else self.executors)[v].run(self.schedules[name][self.rank], inputs=self.tokens, labels=self.targets,
                                           loss_scale=1 / self.m)
            optimizer.step()
            return float(torch.stack(list(result.losses.values())).mean()) if result.losses else None
        if name in V_ARMS:
            return self._torch_v(name, self.reset([p for s in self.v_stages.values() for p in s.parameters()]))
        if kind == "local-v":
            optimizer = self.reset([p for s in self.v_stages.values() for p in s.parameters()])
            self._local_v()
            optimizer.step()
            return None
        if kind == "deepspeed":
            return self._deepspeed()
        optimizer = self.reset(list(self.stage.parameters()))
        if kind == "local":
            self._local()
            optimizer.step()
            return None
        return self._torch(name, optimizer)

    def _deepspeed(self) -> float | None:
        self.reset_layers()
        self.deepspeed.optimizer.state.clear()  # a fresh AdamW: its state starts at the first step
        loss = self.deepspeed.train_batch(iter(list(zip(self.tokens, self.targets))))
        return float(loss) if self.rank == 1 else None

    def _local(self) -> None:
        for j in range(self.m):
            if self.rank == 0:
                self.stage(self.tokens[j]).backward(self.fixed[j])
            else:
                (loss_fn(self.stage(self.fixed[j].requires_grad_(True)), self.targets[j]) / self.m).backward()

    def _local_v(self) -> None:
        """The V's two stages of this rank, each on its own (rank 0: the first from the tokens and fixed
        output gradients, the last from fixed inputs to the loss; rank 1: both middle ones)."""
        for j in range(self.m):
            for s, module in sorted(self.v_stages.items()):
                if s == 0:
                    module(self.tokens[j]).backward(self.fixed[j])
                elif s == 3:
                    (loss_fn(module(self.fixed[j].requires_grad_(True)), self.targets[j]) / self.m).backward()
                else:
                    module(self.fixed[j].requires_grad_(True)).backward(self.fixed[j])

    def _torch(self, name: str, optimizer: torch.optim.Optimizer) -> float | None:
        import torch.distributed.pipelining as pipelining

        stage = pipelining.PipelineStage(self.stage, self.rank, 2, torch.device("cpu"))
        cls = getattr(pipelining, name)
        schedule = cls([stage] if "Interleaved" in name else stage, n_microbatches=self.m, loss_fn=loss_fn)
        if self.rank == 0:
            schedule.step(torch.cat(self.tokens))
            optimizer.step()
            return None
        losses: list[torch.Tensor] = []
        schedule.step(target=torch.cat(self.targets), losses=losses)
        optimizer.step()
        return float(torch.stack(losses).detach().mean())


    def _torch_v(self, name: str, optimizer: torch.optim.Optimizer) -> float | None:
        import torch.distributed.pipelining as pipelining

        stages = [pipelining.PipelineStage(module, s, 4, torch.device("cpu")) for s, module in sorted(self.v_stages.items())]
        schedule = getattr(pipelining, name)(stages, n_microbatches=self.m, loss_fn=loss_fn)
        if self.rank == 0:  # the first and the last stage
            losses: list[torch.Tensor] = []
            schedule.step(torch.cat(self.tokens), target=torch.cat(self.targets), losses=losses)
            optimizer.step()
            return float(torch.stack(losses).detach().mean())
        schedule.step()
        optimizer.step()
        return None


def arm_names(args: argparse.Namespace) -> list[str]:
    names = [f"zerodist:{n}" for n in ZD] + [f"zerodist:{n}-base" for n in ZD if args.baseline]
    names += [f"torch:{n}" for n in TORCH]
    if deepspeed_missing() is None:
        names.append(DEEPSPEED)
    if args.arms:
        names = [n for n in names if any(word.lower() in n.lower() for word in args.arms)]
    return ["local", "local-v"] + names


def configs(args: argparse.Namespace) -> list[argparse.Namespace]:
    out = []
    for m in args.micro_batches:
        for shape in args.shapes:
            batch, seq = (int(x) for x in shape.lower().split("x"))
            out.append(argparse.Namespace(**{**vars(args), "micro_batches": m, "batch": batch, "seq": seq}))
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import zerodist.comm as comm

    comm.init_distributed()
    if deepspeed_missing() is None:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # wraps the group zerodist set up
    names = arm_names(args)
    results = []
    for config in configs(args):
        arms = Arms(rank, config)
        times: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, list[float]] = {n: [] for n in names}  # this rank's CPU seconds (waits excluded)
        kernel: dict[str, list[tuple[float, int]]] = {n: [] for n in names}  # its system seconds, minor faults
        losses: dict[str, float | None] = {}
        for round_index in range(args.rounds + 1):  # round 0 warms up
            # each round starts one arm later, so no arm always runs after the same one (whose heap,
            # caches and page faults it would inherit every time)
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                comm.barrier()
                usage = resource.getrusage(resource.RUSAGE_SELF)
                start, start_cpu = time.perf_counter(), time.process_time()
                losses[name] = arms.run(name)
                used = time.process_time() - start_cpu
                after = resource.getrusage(resource.RUSAGE_SELF)
                comm.barrier()
                if round_index:
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(used)
                    kernel[name].append((after.ru_stime - usage.ru_stime, after.ru_minflt - usage.ru_minflt))
        everyone: list = [None] * world
        comm.all_gather_object(everyone, (losses, {n: statistics.median(c) for n, c in cpu.items()},
                                           {n: (statistics.median(k[0] for k in ks), statistics.median(k[1] for k in ks))
                                            for n, ks in kernel.items()}))
        # the last stage is on rank 1, or rank 0 in a V; the busier rank's CPU time bounds the step
        merged = {n: next((d[0][n] for d in everyone if d[0][n] is not None), None) for n in names}
        busiest = {n: max(d[1][n] for d in everyone) for n in names}
        system = {n: (max(d[2][n][0] for d in everyone), max(d[2][n][1] for d in everyone)) for n in names}
        results.append((config, times, merged, busiest, system))
        del arms
    if rank == 1:
        queue.put(results)


def report(config: argparse.Namespace, rounds_times: dict[str, list[float]], losses: dict[str, float | None],
           cpu: dict[str, float], system: dict[str, tuple[float, float]], rounds: int) -> bool:
    """The table; "cpu x local" is the busier rank's CPU time over local's (waits excluded, so it
    reads the same on a loaded machine): above 1 is work the arm adds, the rest of "x local" idle.
    "best" is the same ratio of the fastest rounds (the arm's over local's): what each arm does
    with the least interference, since another process can only slow a round down."""
    times = {name: statistics.median(values) for name, values in rounds_times.items()}
    best = {name: min(values) for name, values in rounds_times.items()}
    params = sum(p.numel() for layer in layers_of(config) for p in layer.parameters())
    kib = config.batch * config.seq * config.d_model * 4 / 1024
    print(f"\nGPT {params / 1e6:.1f}M params in 2 stages, {config.micro_batches} micro-batches of "
          f"{config.batch}x{config.seq} (activation messages of {kib:.0f} KiB), AdamW, 2 gloo ranks, 1 thread "
          f"each; median and best of {rounds} rotated rounds; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'arm':<38} {'step s':>8} {'x local':>8} {'ideal':>7} {'x ideal':>8} {'best':>6} {'cpu x local':>11} "
          f"{'sys ms':>7} {'faults':>7} {'loss':>10}")
    local = times["local"]
    for name, wall in times.items():
        v_base = name.removesuffix("-base").endswith(V_ARMS) or name == "local-v"
        base = times["local-v"] if v_base else local
        ideal = base / local * (1 + bubble(name, 2, config.micro_batches))  # in units of local
        best_ideal = (best["local-v"] if v_base else best["local"]) * (1 + bubble(name, 2, config.micro_batches))
        loss = losses.get(name)
        print(f"{name:<38} {wall:>8.3f} {wall / local:>8.3f} {ideal:>7.3f} {wall / local / ideal:>8.3f} "
              f"{best[name] / best_ideal:>6.3f} "
              f"{cpu[name] / cpu['local']:>11.3f} {system[name][0] * 1e3:>7.0f} {system[name][1]:>7.0f} "
              f"{'' if loss is None else f'{loss:.6f}':>10}")
    finals = {f"{loss:.6g}" for name, loss in losses.items() if loss is not None}
    print("same final loss to 6 digits in every pipeline arm:", len(finals) == 1, sorted(finals))
    return len(finals) == 1


# what `zerodist run --keep-heap` gives the ranks ([Note: keeping the host heap] in zerodist/cli/run.py)
from zerodist.cli.run import KEEP_HEAP_ENV as KEEP_HEAP  # noqa: E402


def run_pair(args: argparse.Namespace, heap: str) -> list | None:
    """One process pair's results, its ranks started with glibc's defaults or keeping freed memory
    (the variables are read by glibc when each spawned rank starts)."""
    import torch.multiprocessing as mp

    saved = {key: os.environ.get(key) for key in KEEP_HEAP}
    if heap == "keep":
        os.environ.update(KEEP_HEAP)
    try:
        queue = mp.get_context("spawn").SimpleQueue()
        error = run_ranks(worker, (2, free_port(), args, queue), nprocs=2, timeout_s=args.timeout_s)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if error:
        print(f"2 ranks ({heap} heap): {error}")
        return None
    return queue.get()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--shapes", nargs="+", default=["4x128"], help="micro-batch shapes, batch x seq")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--arms", nargs="*", default=[], help="keep the arms whose name has one of these words")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--keep-heap", action="store_true", help="the same as --heap keep")
    parser.add_argument("--heap", choices=["default", "keep", "both"], default="default",
                        help="keep: ranks run with glibc told to keep freed memory (MALLOC_TRIM_THRESHOLD_, "
                             "MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_), so no page faults from memory handed back; "
                             "both: one process pair each way, default first")
    parser.add_argument("--baseline", action="store_true",
                        help="add a '-base' arm per zerodist schedule: receives not pooled, I and W never fused")
    args = parser.parse_args()
    heaps = ["keep"] if args.keep_heap else ["default", "keep"] if args.heap == "both" else [args.heap]
    missing = deepspeed_missing()
    if missing is not None:
        print(f"DeepSpeed's PipelineEngine arm left out: `import deepspeed` fails here ({missing}); run this "
              "benchmark with a python where DeepSpeed imports (benchmarks/README.md)")
    same = []
    for heap in heaps:
        results = run_pair(args, heap)
        if results is None:
            return 1
        print(f"\n=== glibc {'keeping freed memory (--heap keep)' if heap == 'keep' else 'defaults'} ===")
        same += [report(config, times, losses, cpu, system, args.rounds)
                 for config, times, losses, cpu, system in results]
        sys.stdout.flush()
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
