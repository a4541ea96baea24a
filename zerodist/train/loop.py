"""The training loop `zerodist train` runs on every rank: a byte-level GPT on the stdlib corpus.

    plan -> model (same seed on every rank) -> zerodist.initialize -> steps under the comm
    tracer, loss averaged over ranks for the progress bar -> per-rank memory gathered ->
    rank 0 writes metrics.csv, loss.png, config.json, summary.txt and prints the summary.

Only rank 0 prints; every rank runs every collective (the loss averaging and the memory
gather included), so no rank waits on one that skipped a step.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

import zerodist
import zerodist.comm as comm
from zerodist.data import TokenDataset, split_corpus, stdlib_corpus
from zerodist.debug.memory import peak_rss_bytes, rss_bytes
from zerodist.engine import Engine
from zerodist.models import GPT, count_parameters, gpt_config
from zerodist.tensor_parallel import schedule_log
from zerodist.train.metrics import MetricsLog, StepHistory, StepRecord, plot_loss, read_csv, read_losses
from zerodist.comm.quantized import QGZ_LABEL, measure_quantization_error
from zerodist.train.link_report import link_lines
from zerodist.train.observe import StepObserver
from zerodist.train.options import Progress, TrainOutcome, TrainPlan
from zerodist.train.report import (RankMemory, RunSummary, expected_bus_bytes, expected_state_bytes, format_summary,
                                   loss_line)
from zerodist.train.seq_report import SavedActivations, SequenceReport, ring_formula, ulysses_formula
from zerodist.train.seq_report import report_lines as sequence_report_lines
from zerodist.train.tp_report import measure_from_log, report_lines

if TYPE_CHECKING:
    from zerodist.models.moe_gpt import MoEGPT

try:  # the debug layer's reduction, token-weighted and checked on every rank
    from zerodist.debug import reduce_loss
except ImportError:  # an older tree without zerodist.debug.reduce_loss: the plain mean is the same here
    def reduce_loss(loss: torch.Tensor) -> torch.Tensor:  # type: ignore[misc]  # the old signature
        averaged = loss.detach().float().clone()
        comm.all_reduce(averaged, op=comm.ReduceOp.AVG)
        return averaged


def build_dataset(plan: TrainPlan, seq_len: int) -> TokenDataset:
    train_bytes, _ = split_corpus(stdlib_corpus(max_bytes=plan.corpus_bytes, seed=plan.seed))
    return TokenDataset(train_bytes, seq_len)


def endless(loader: Any) -> Iterator[Any]:
    """Batch after batch; each new pass over the loader is a new, reshuffled epoch."""
    while True:
        yield from loader


def micro_steps(engine: Engine, batches: Iterator[Any], device: torch.device,
                activations: SavedActivations | None = None,
                before_step: Callable[[torch.Tensor], None] | None = None,
                observer: StepObserver | None = None) -> torch.Tensor:
    """One optimizer step (all its micro-steps); returns this rank's mean loss over them.
    `activations` measures the first micro-step's forward. `before_step(mean loss)` runs before the
    last micro-step's `engine.step()`, the one that steps the optimizer and may save a checkpoint.
    `observer` times each phase."""
    losses = []
    accumulation = engine.gradient_accumulation_steps()
    phase = observer.phase if observer is not None else (lambda name: contextlib.nullcontext())
    for micro in range(accumulation):
        # (inputs, targets), or with a sequence axis this rank's slices and their position ids
        batch = next(batches)
        with activations.measure() if activations is not None and micro == 0 else contextlib.nullcontext():
            with phase("forward"):
                loss = engine(*(t.to(device) for t in batch))
        with phase("backward"):
            engine.backward(loss)
        losses.append(loss.detach().float())
        if before_step is not None and micro == accumulation - 1:
            before_step(torch.stack(losses).mean())
        with phase("step"):
            engine.step()
    return torch.stack(losses).mean()


def pipeline_batch(engine: Engine, batches: Iterator[Any], before_step: Callable[[torch.Tensor], None],
                   observer: StepObserver | None = None) -> torch.Tensor:
    """One pipeline optimizer step: `engine.train_batch(batches)`, the plain loop's micro-batches in the
    plain loop's (shuffled) order, so a pipeline trains on the plain run's data (the first and last
    stages read them). `before_step(agreed loss)` runs after the schedule and before the optimizer
    step's interval save, the executor's timed actions then in the observer's breakdown."""
    written: list[bool] = []

    def row() -> None:
        if not written and engine.agg_train_loss is not None:
            written.append(True)
            if observer is not None:
                observer.pipeline_phases(engine.last_run)
            before_step(engine.agg_train_loss)

    with engine.before_interval_save(row):
        loss = engine.train_batch(batches)
    row()  # an engine that stepped without asking its saves: the row all the same
    return loss


class ProgressBar:
    """tqdm on rank 0 (nothing elsewhere): loss, tokens/s over the last 10 steps, RSS."""

    def __init__(self, steps: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=steps, unit="step", dynamic_ncols=True, mininterval=0.5)
        self.recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=10)

    def update(self, record: StepRecord, tokens: int, seconds: float) -> None:
        self.recent.append((tokens, seconds))
        if self.bar is None:
            return
        rate = sum(t for t, _ in self.recent) / max(1e-9, sum(s for _, s in self.recent))
        self.bar.set_postfix_str(f"loss {record.loss:.3f}, {rate:,.0f} tok/s, rss {record.rss_bytes / 2**20:.0f} MiB",
                                 refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_steps(engine: Engine, loader: Any, steps: int, seq_len: int, metrics: MetricsLog | None = None,
              activations: SavedActivations | None = None,
              observer: StepObserver | None = None,
              last_step: dict[str, Any] | None = None) -> tuple[StepHistory, float, Any, Any]:
    """Train `steps` optimizer steps; returns (what is kept of the records: [Note: bounded step history], seconds, tracer of everything, bytes and
    bus bytes of the loss averaging alone). The loss averaging runs in a nested trace so the summary can
    tell the engine's traffic from the progress bar's. Each step's row goes to `metrics` before its
    optimizer step, its tokens/s over the time since the previous row (one whole step).

    [Note: rows before the save] The interval save runs inside the step's last `engine.step()`; a
    row written after it was lost when the process was killed right after the run's final save
    (the restart then finds nothing left to train). Written before it, with the loss known then,
    a row is never missing for a saved step; a row past the checkpoint is dropped on resume."""
    device = comm.device_for_rank()
    tokens = engine.batch.train_batch_size * seq_len
    batches = endless(loader)
    first = engine.global_steps + 1  # after 1 when a checkpoint was resumed
    bar = ProgressBar(steps - first + 1, enabled=comm.get_rank() == 0)
    records = StepHistory()
    logging_traffic = [0, 0.0]  # bytes and bus bytes of the loss averaging, summed as the steps go
    started = time.perf_counter()
    # Totals only, not a record per collective: memory stays flat however long the run.
    mark = [started]  # when the previous step's row was written

    pipelined = engine.pipeline is not None  # train_batch's loss is already agreed over the ranks

    def write_row(step: int, lr: float, local_loss: torch.Tensor) -> None:
        # Before the step's engine.step(), which may save the run's last checkpoint: a kill right
        # after that save keeps every row ([Note: rows before the save]).
        with comm.trace(keep_records=False) as logging_trace:
            loss = float(local_loss) if pipelined else float(reduce_loss(local_loss))
        logging_traffic[0] += logging_trace.total_bytes()
        logging_traffic[1] += logging_trace.bus_bytes()
        now = time.perf_counter()
        seconds, mark[0] = now - mark[0], now
        record = StepRecord(step, loss, lr, tokens / seconds, rss_bytes(),
                            observer.columns(step, seconds) if observer is not None else {})
        records.append(record)
        if metrics is not None:
            metrics.append(record)
        bar.update(record, tokens, seconds)

    with comm.trace(keep_records=False) as everything, _logs_beside(bar), contextlib.ExitStack() as stack:
        for step in range(first, steps + 1):
            lr = engine.get_lr()[0]  # the rate this step uses; the scheduler moves it on in engine.step()
            if step == steps and last_step is not None:  # past one machine: the last step's bytes (and ZeRO++'s error)
                last_step["trace"] = stack.enter_context(comm.trace(keep_records=False))
                if last_step.get("quantized"):
                    last_step["meter"] = stack.enter_context(measure_quantization_error())
            with observer.step(step) if observer is not None else contextlib.nullcontext():
                if pipelined:
                    run = functools.partial(pipeline_batch, engine, batches, functools.partial(write_row, step, lr),
                                            observer)
                else:
                    run = functools.partial(micro_steps, engine, batches, device,
                                            activations if step == first else None,
                                            functools.partial(write_row, step, lr), observer)
                if observer is not None:
                    observer.run(step, run)
                else:
                    run()
    bar.close()
    elapsed = time.perf_counter() - started
    return records, elapsed, everything, tuple(logging_traffic)


def _logs_beside(bar: ProgressBar) -> Any:
    """The engine's log lines printed above the bar instead of through it."""
    if bar.bar is None:
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm(loggers=[logging.getLogger("zerodist")])


def gather_memory(engine: Engine) -> list[RankMemory]:
    """Every rank's model-state bytes and peak RSS (a collective: every rank calls it)."""
    everyone: list[Any] = [None] * comm.get_world_size()
    expected = None
    if engine.pipeline is not None:  # each stage's ranks hold their own Ψ: each rank's own formula
        world = engine.topology.size(*engine.topology.dense_axes)
        _, psi_by_stage, narrow = _psi(engine, world)
        expected = expected_state_bytes(psi_by_stage, narrow, engine.policy.name != "fp32", world)
    comm.all_gather_object(everyone, RankMemory(comm.get_rank(), engine.model_state_bytes(), peak_rss_bytes(),
                                                expected))
    return everyone


def _psi(engine: Engine, world: int) -> tuple[int, dict[int, int], list[tuple[int, int, int]]]:
    """This rank's padded Ψ: in all, by the stage its group runs, and its groups sharded over fewer ranks."""
    psi = sum(g.layout.total_numel for g in engine.groups)
    psi_by_stage: dict[int, int] = {}
    narrow: list[tuple[int, int, int]] = []  # MoE experts: sharded over their data group only
    for group in engine.groups:  # stage 3 keeps parameters under the persistence threshold in stage-2 groups
        if group.domain_group.size != world:
            narrow.append((group.policy.stage, group.layout.total_numel, group.domain_group.size))
            continue
        psi_by_stage[group.policy.stage] = psi_by_stage.get(group.policy.stage, 0) + group.layout.total_numel
    return psi, psi_by_stage, narrow


def summarize(engine: Engine, records: StepHistory, elapsed: float, everything: Any, logging_traffic: tuple,
              memory: list[RankMemory], seq_len: int) -> RunSummary:
    zero = engine.config.zero_optimization
    # the ranks dense parameters are sharded over: the batch shards, times the sequence degree
    world = engine.topology.size(*engine.topology.dense_axes)
    psi, psi_by_stage, narrow = _psi(engine, world)
    # a pipeline reduces its gradients once per batch, after the schedule ([Note: pipeline under ZeRO])
    syncs = 1 if engine.pipeline is not None else engine.gradient_accumulation_steps()
    tokens = len(records) * engine.batch.train_batch_size * seq_len
    return RunSummary(
        steps=len(records), world_size=world, stage=zero.stage, precision=engine.policy.name, elapsed_s=elapsed,
        first_loss=records.first_loss if records.first_loss is not None else math.nan,
        last_losses=records.recent_losses() or [math.nan], tokens_per_s=tokens / elapsed, psi=psi, psi_by_stage=psi_by_stage, memory=memory,
        comm_table=everything.format_summary(), comm_bytes=everything.total_bytes(),
        comm_bus_bytes=everything.bus_bytes(),
        logging_bytes=logging_traffic[0],
        logging_bus_bytes=logging_traffic[1],
        # the dense groups over the N ranks, the narrow ones (MoE experts) over their own ranks
        expected_bus_bytes_per_step=sum(expected_bus_bytes(
            stage=zero.stage, psi=count, world_size=ranks, accumulation_steps=syncs,
            reduce_scatter=zero.reduce_scatter, element_bytes=engine.policy.param_dtype.itemsize)
            for count, ranks in [(sum(psi_by_stage.values()), world), *((n, r) for _, n, r in narrow)]),
        narrow_groups=tuple(narrow),
        tensor_degree=engine.topology.size("tensor"),
        sequence_degree=engine.topology.size("sequence"),
        pipe_degree=engine.topology.size("pipe"),
    )


def header_lines(plan: TrainPlan, engine: Engine, model: GPT | MoEGPT) -> list[str]:
    batch = engine.batch
    return [f"zerodist train: GPT {plan.model!r} ({count_parameters(model):,} parameters, seq {model.config.seq_len}), "
            f"{plan.steps} steps on {comm.get_world_size()} rank(s), batch {batch.train_batch_size} = micro "
            f"{batch.micro_batch_size} x accumulation {batch.gradient_accumulation_steps} x ranks "
            f"{engine.topology.size('data', 'expert')}, seed {plan.seed}, output {plan.out}",
            "config:\n" + json.dumps(plan.config, indent=2)]


def write_outputs(plan: TrainPlan, summary: RunSummary, sections: list[str] | None = None) -> list[str]:
    """Rank 0's files (summary.txt: the summary and the axes' `sections`; loss.png from metrics.csv,
    which MetricsLog wrote row by row); returns the lines that say what was written (or skipped)."""
    plan.out.mkdir(parents=True, exist_ok=True)
    write_config(plan)
    text = "\n".join([format_summary(summary), *(sections or [])])
    (plan.out / "summary.txt").write_text(text + "\n", encoding="utf-8")
    lines = [f"wrote {plan.out / 'metrics.csv'}, {plan.out / 'config.json'}, {plan.out / 'summary.txt'}"]
    skipped = plot_loss(*read_losses(plan.out / "metrics.csv"), plan.out / "loss.png", f"GPT {plan.model}, ZeRO stage {summary.stage}, "
                        f"{summary.world_size} rank(s)")
    lines.append(f"loss curve not written: {skipped}" if skipped else f"wrote {plan.out / 'loss.png'}")
    return lines


def write_config(plan: TrainPlan) -> None:
    """config.json: rank 0 writes it before the first step (a run killed later still has it) and again at the end."""
    plan.out.mkdir(parents=True, exist_ok=True)
    (plan.out / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n", encoding="utf-8")


def rebuilt_summary(plan: TrainPlan, history: list[StepRecord], resumed: int) -> list[str]:
    """summary.txt and config.json of a run killed between its final save and its outputs, from
    metrics.csv (whose rows are written before each save: [Note: rows before the save])."""
    lines = []
    if not (plan.out / "config.json").is_file():
        write_config(plan)
        lines.append(f"wrote {plan.out / 'config.json'}")
    if history and not (plan.out / "summary.txt").is_file():
        text = (f"summary: {len(history)} steps, rebuilt from metrics.csv (the run stopped after its final "
                f"checkpoint, step {resumed}, before writing its summary: no throughput, memory or traffic figures)\n"
                f"  {loss_line(history[0].loss, [r.loss for r in history[-10:]])}")
        (plan.out / "summary.txt").write_text(text + "\n", encoding="utf-8")
        lines.append(f"wrote {plan.out / 'summary.txt'}")
    return lines


def finished_already(plan: TrainPlan, resumed: int, rank0: bool) -> TrainOutcome:
    """The checkpoint resumed from is at or past `--steps`: 0 with one line when the run is
    complete (a restart after the final save), 2 naming both numbers when `--steps` is below it."""
    save_dir = plan.config.get("checkpoint", {}).get("save_dir")
    if resumed > plan.steps:
        return TrainOutcome(2, errors=[
            f"zerodist train: --steps {plan.steps} is below the step of the checkpoint resumed from ({resumed}, in "
            f"{save_dir}); pass --steps {resumed} or more to train on from it, or another --out to start afresh"
        ] if rank0 else [])
    if not rank0:
        return TrainOutcome(0)
    history = read_csv(plan.out / "metrics.csv", resumed)
    if history:  # a run killed between its final save and its outputs: the plot from the kept rows
        plot_loss([r.step for r in history], [r.loss for r in history], plan.out / "loss.png", f"GPT {plan.model}, {comm.get_world_size()} rank(s)")
    rebuilt = rebuilt_summary(plan, history, resumed)
    return TrainOutcome(0, [f"zerodist train: nothing left to train: the checkpoint in {save_dir} is at step {resumed} "
                            f"of --steps {plan.steps}; the run's outputs are in {plan.out}", *rebuilt])


def _moe_lines(plan: TrainPlan, engine: Engine, model: Any, load: Any, everything: Any, steps: int,
               seq_len: int) -> list[str]:
    """Rank 0: the MoE demo's load-balance section and its expert_load.png."""
    from zerodist.train import moe_report

    # the all-to-alls that are not Ulysses' (labelled "sequence") nor qgZ's: the MoE layers'
    others = everything.labelled_bytes("sequence", "all_to_all") + everything.labelled_bytes(QGZ_LABEL, "all_to_all")
    measured = (everything.total_bytes("all_to_all") - others) / max(1, steps)
    from zerodist.moe import MoE

    # a call routes the rank's slice of each sequence, and under Domino one chunk of the micro-batch
    domino = engine.config.zerodist.tensor_parallel.domino
    chunks = domino.chunks if domino is not None and engine.topology.size("tensor") > 1 else 1
    tokens = engine.batch.micro_batch_size // chunks * seq_len // engine.topology.size("sequence")
    formula = moe_report.all_to_all_formula_bytes(model, tokens, engine.batch.gradient_accumulation_steps * chunks,
                                                  engine.policy.param_dtype.itemsize,
                                                  layers=sum(isinstance(m, MoE) for m in engine.module.modules()))
    lines = moe_report.load_lines(load, measured_bytes_per_step=measured, formula_bytes_per_step=formula)
    plan.out.mkdir(parents=True, exist_ok=True)
    path = plan.out / "expert_load.png"
    skipped = moe_report.plot_expert_load(load, path, f"GPT {plan.model}, {plan.moe_experts} experts per block, "
                                                      f"{comm.get_world_size()} rank(s)")
    lines.append(f"expert-load plot not written: {skipped}" if skipped else f"wrote {path}")
    return lines


def _sequence_report(engine: Engine, model: Any, everything: Any, activations: SavedActivations | None, steps: int,
                     seq_len: int) -> SequenceReport | None:
    """The sequence-parallel section (a collective: every rank's activation bytes are gathered). With a
    pipeline the formulas count this rank's stages' blocks; the ring's measured sends are its own
    (labelled "sequence", the stages' "pipe"), but its formula is not drawn up per stage yet."""
    if activations is None:
        return None
    from zerodist.train.pipe_report import rank_blocks

    everyone: list[Any] = [None] * comm.get_world_size()
    comm.all_gather_object(everyone, activations.bytes)
    if engine.pipeline is not None:  # the executor ran the forwards, outside activations.measure()
        everyone = []
    method = engine.config.zerodist.sequence_parallel.method
    micro_steps_run = max(1, steps * engine.batch.gradient_accumulation_steps)
    # Ulysses' all-to-alls are labelled "sequence" (zerodist/sequence/layer.py): told from qgZ's and MoE's
    ulysses = everything.labelled_bus_bytes("sequence", "all_to_all")
    # the ring's blocks are labelled "sequence", a pipeline's messages "pipe" (comm.p2p)
    measured = ulysses if method == "ulysses" else everything.labelled_bytes("sequence", "send")
    layers = rank_blocks(engine)
    ring = ring_formula(engine, seq_len, model.config, layers) if method == "ring" and engine.pipeline is None else None
    return SequenceReport(engine.topology.size("sequence"), method, measured / micro_steps_run,
                          ulysses_formula(engine, seq_len, model.config, layers) if method == "ulysses" else None,
                          everyone, ring)


def _pipeline_lines(plan: TrainPlan, engine: Engine, model: Any, everything: Any, steps: int,
                    observer: StepObserver) -> list[str]:
    """The pipeline section (a collective); empty without a pipeline."""
    if engine.pipeline is None:
        return []
    from zerodist.train.pipe_report import pipeline_section

    title = (f"GPT {plan.model}, {plan.pipe_schedule}, {plan.pipe} pipe ranks, "
             f"{engine.pipeline.micro_batches} micro-batches")
    return pipeline_section(engine, plan.pipe_schedule, model.config.seq_len, model.config.d_model,
                            float(everything.labelled_bytes("pipe", "send")), steps, title, observer, plan.out)


def build_model(plan: TrainPlan) -> tuple[GPT | MoEGPT, torch.nn.Module, Any]:
    """(the demo GPT, what initialize() takes: the GPT or, with a pipeline, this rank's stages of it
    cut by `split_model` under the model's own names, so its checkpoints are the plain run's; the MoE
    load tracker or None)."""
    torch.manual_seed(plan.seed)  # every rank builds the same weights (rank 0's are broadcast anyway)
    tracker = None
    if plan.moe_experts:
        from zerodist.train import moe_report

        # the experts spread over the expert axis (a stage's ranks that do not share a sample)
        model: GPT | MoEGPT = moe_report.build_moe_model(plan.model, plan.moe_experts, plan.expert_degree,
                                                         seq_len=plan.seq_len)
        tracker = moe_report.LoadTracker(model)
    else:
        model = GPT(gpt_config(plan.model, **({"seq_len": plan.seq_len} if plan.seq_len else {})))
    if plan.pipe == 1:
        return model, model, tracker
    from zerodist.pipe import split_model

    return model, split_model(model, num_stages=plan.pipe,
                              stages_per_rank=2 if plan.pipe_schedule == "interleaved" else 1), tracker


def train(plan: TrainPlan, progress: Progress | None = None) -> TrainOutcome:
    """Train on this rank. Rank 0's header goes to `progress` before the first step; the outcome
    carries the exit code (0 when the run finished with a finite loss, 1 otherwise) and rank 0's
    report, which the CLI shows (zerodist/cli/train.py)."""
    model, module, tracker = build_model(plan)
    seq_len = model.config.seq_len
    dataset = build_dataset(plan, seq_len)
    engine, _, loader, _ = zerodist.initialize(model=module, config=plan.config, training_data=dataset)
    rank0 = comm.get_rank() == 0
    resumed = engine.global_steps  # the step of the checkpoint resumed from; 0 for a fresh run
    if resumed >= plan.steps:
        engine.destroy()
        return finished_already(plan, resumed, rank0)
    if rank0 and progress is not None:
        for line in header_lines(plan, engine, model):
            progress(line)
        if engine.pipeline is not None:
            from zerodist.train.pipe_report import header_line

            progress(header_line(engine, plan.pipe_schedule))
    if rank0:
        write_config(plan)
    # the rows up to the checkpoint are rewritten, then dropped from memory ([Note: bounded step history])
    metrics = MetricsLog(plan.out / "metrics.csv", read_csv(plan.out / "metrics.csv", resumed) if resumed else []
                         ) if rank0 else None
    activations = SavedActivations(engine.module) if engine.topology.size("sequence") > 1 else None
    observer = StepObserver(engine.config, plan.out, engine.module, dtype=engine.policy.param_dtype,
                            module_spans=engine.pipeline is None)
    zero = engine.config.zero_optimization
    quantized = zero.zero_quantized_weights or zero.zero_quantized_gradients
    last_step = {"quantized": quantized} if engine.topology.num_nodes > 1 or quantized else None
    try:
        with schedule_log() as tensor_parallel_log:  # tensor-parallel bytes and Domino's schedule
            records, elapsed, everything, logging_traffic = run_steps(engine, loader, plan.steps, seq_len, metrics,
                                                                      activations, observer, last_step)
        memory = gather_memory(engine)
        observed = observer.finish({"model": plan.model, "stage": engine.config.zero_optimization.stage})
        sequence = _sequence_report(engine, model, everything, activations, len(records), seq_len)
        load = tracker.gather() if tracker is not None else None
        pipe_lines = _pipeline_lines(plan, engine, model, everything, len(records), observer)
    finally:
        engine.destroy()
        if metrics is not None:
            metrics.close()
    summary = summarize(engine, records, elapsed, everything, logging_traffic, memory, seq_len)
    outcome = TrainOutcome(0, summary=summary)
    if rank0:
        sections = list(pipe_lines)  # each axis' bytes against its formula: on screen and in summary.txt
        if engine.topology.size("tensor") > 1:
            report = measure_from_log(engine, model.config, tensor_parallel_log,
                                      len(records) * engine.batch.gradient_accumulation_steps,
                                      moe=bool(plan.moe_experts))
            sections.append("\n".join("  " + line for line in report_lines(report)))
        if sequence is not None:
            sections.append("\n".join("  " + line for line in sequence_report_lines(sequence)))
        if last_step is not None and "trace" in last_step:
            sections.append("\n".join("  " + line for line in link_lines(engine, last_step["trace"],
                                                                          last_step.get("meter"))))
        outcome.lines += [format_summary(summary), *observed, *sections]
        if load is not None:
            outcome.lines += _moe_lines(plan, engine, model, load, everything, len(records), seq_len)
        outcome.lines += write_outputs(plan, summary, sections)
    if engine.interval_saves.last_error is not None:  # the same on every rank: a save's outcome is agreed
        outcome.code = 1
        if rank0:
            outcome.lines.append(f"zerodist train: the run ended with its last interval save failed, so its last steps "
                                 f"are not saved: {engine.interval_saves.last_error}")
    elif not all(math.isfinite(loss) for loss in records.recent_losses()[-1:]):
        outcome.code = 1
        if rank0:
            outcome.lines.append("zerodist train: the loss is not finite at the last step; lower --lr or use --bf16")
    return outcome
