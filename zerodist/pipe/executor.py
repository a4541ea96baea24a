"""The executor: runs one pipe rank's actions of a `Schedule` on a `PipelineModule`.

    executor = PipelineExecutor(module, pipe_ranks=[0, 2], timeout_s=60)
    result = executor.run(schedule[pipe_rank], inputs=[...], labels=[...], loss_scale=1 / m,
                          after_backward=reducer_end_backward)

Each action is done as the schedule says, in its order ([Note: p2p headers] in
zerodist/comm/p2p.py for the messages):
- F(s, j): the stage's layers on micro-batch j's input (the data for stage 0, else what RECV_F or
  the previous stage on this rank handed over); the input's floating tensors become leaves that
  require grad, so the backward yields their gradients. The outputs (the loss, on the last stage)
  are stashed until the backward of (s, j).
- B(s, j): backward from the stashed outputs with the received output gradients (from the loss
  times `loss_scale` on the last stage); the input gradients are kept for SEND_B. Zero-bubble
  splits it: I(s, j) computes only the input gradients (graph retained), W(s, j) only the weight
  gradients, from the gradients I kept at the weight branches: together one backward's work
  ([Note: split backward] in zerodist/pipe/backward_split.py). An I directly followed by its own W
  (nothing between: no send waits for the input gradient) runs as one B (`fuse_split_backward`):
  the split costs a few percent over one backward and buys nothing there.
- SEND_*: non-blocking; every send is waited for at the end of the run. RECV_*: blocking, with
  `timeout_s`, on a message whose header receive was posted when the run started and whose
  payload receive was posted as soon as the header was there (polled before every action):
  [Note: receives posted ahead] in zerodist/comm/p2p.py. A sender never waits for its receiver
  to reach the RECV. `receive_ahead=False` posts each receive at its RECV (the benchmark's
  baseline; always so where the backend matches messages by order, not tag: [Note: p2p on NCCL]).
- Inputs and labels are moved to the rank's device (`comm.device_for_rank()`) at F, so a loader of
  CPU tensors feeds a pipeline on a GPU.

[Note: receive buffer pool] A received payload lands in a buffer from the executor's pool (one
list of free buffers per shape, dtype and device, kept across runs), and goes back to it when the
backward of its micro-batch is done (its stash entry popped at B, or at W when split): in
training, a received activation is only the leaf the input gradient is taken of (the layers get a
clone, whose backward reads nothing), and a received output gradient is read by the backward only.
An output gradient that the backward handed on unchanged (the input gradient sent back, or a
weight's `.grad` that autograd took as it was) is not given back: its storage is still in use. Only
buffers the pool lent are taken back (it records them at `take`): a small message's tensors came
inside the header ([Note: p2p headers]) as fresh copies and are never pooled. So after the first
step no receive allocates, as DeepSpeed's engine receives into buffers it keeps; non-floating
tensors (handed to the layers as they are) are not given back, and evaluation does not use the
pool at all (its layers get the received tensors themselves, which a kept output may hold): it
allocates, and leaves the training buffers where they are. The buffers are overwritten whole by
the next payload, so results are bitwise the same. At the end of a training run the pool keeps,
per shape, as many free buffers as that run had lent at once and none of a shape it did not
receive (a sequence length that changes between steps leaves only the last one's), so between
runs it holds as many buffers as were in use at once (1F1B: a few per neighbour; GPipe: one per
micro-batch, whose activations it held anyway); `executor.pool.clear()` lets them go.

`after_backward()` is called after every backward that wrote weight gradients (B, W): the engine
hands them to ZeRO's reducer, which defers them until the batch's one reduction. UNSHARD, RESHARD
and REDUCE_GRAD ([Note: sharding actions] in schedule.py) go to `sharding(action)`, the engine's
(it gathers, frees and reduces through ZeRO's unit runtime). The executor knows nothing of ZeRO,
optimizers or data parallelism. Any failure sends an abort to both pipe
neighbours, so every stage stops by name instead of waiting for a message that never comes.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zerodist.comm import p2p, timeline
from zerodist.pipe.backward_split import SplitBackward, input_backward, weight_backward
from zerodist.pipe import checkpointing
from zerodist.pipe.module import PipelineModule
from zerodist.pipe.schedule import Action, Kind, schedule_placement, stage_to_rank

__all__ = ["ExecutedAction", "PipelineError", "PipelineExecutor", "RunResult", "check_module_for_schedule",
           "fuse_split_backward"]


class PipelineError(RuntimeError):
    """An engine call that pipeline mode does not offer (DeepSpeed's name and message)."""

_ACTIVATION, _GRADIENT = 1, 2


def check_module_for_schedule(module: PipelineModule, schedule: str) -> None:
    """The schedule's stage placement is the module's, and a schedule that splits the backward (I, W)
    gets no reentrant activation checkpoint, which torch refuses under `autograd.grad` (raised
    alike on every rank, before any message)."""
    splits = isinstance(schedule, str) and schedule.lower() in ("zb", "zbv", "dualpipev")
    if (splits and module.activation_checkpoint_interval > 0
            and module.activation_checkpoint_func is checkpointing.checkpoint):
        raise ValueError(f"pipeline schedule {schedule!r} splits the backward into input and weight gradients, which "
                         "torch's reentrant activation checkpoint does not allow; set the config's pipeline.use_reentrant: "
                         "false (or activation_checkpoint_func=non_reentrant_checkpoint), or use schedule 1f1b")
    wanted = schedule_placement(schedule)
    if module.stage_placement != wanted:
        fix = ("PipelineModule(..., stages_per_rank=2, stage_placement='v')" if wanted == "v"
               else "PipelineModule(...) without stage_placement='v'")
        raise ValueError(f"pipeline schedule {schedule!r} places stages {wanted!r} but the PipelineModule was built with "
                         f"stage_placement={module.stage_placement!r}; build it as {fix}")


def fuse_split_backward(actions: Sequence[Action]) -> list[Action]:
    """A rank's actions with every I(s, j) that is directly followed by W(s, j) replaced by one
    B(s, j). Nothing runs between the two, so nothing needed the input gradient before the weight
    gradients: one backward gives the same gradients (bitwise: [Note: split backward]) without the
    split's extra graph walk and kernels (I + W measured 1.04x one B on the GPT's blocks). The
    zero-bubble schedules keep I and W apart exactly where it helps (an I whose gradient is sent,
    or whose W is deferred), so those stay split: ZB-V's middle stage and the first stage's pairs
    (whose I has no input gradient to compute) are the ones fused."""
    out: list[Action] = []
    index = 0
    while index < len(actions):
        action = actions[index]
        following = actions[index + 1] if index + 1 < len(actions) else None
        if (action.kind is Kind.I and following is not None and following.kind is Kind.W
                and (following.stage, following.microbatch) == (action.stage, action.microbatch)):
            out.append(Action(Kind.B, action.stage, action.microbatch))
            index += 2
            continue
        out.append(action)
        index += 1
    return out


@dataclasses.dataclass(frozen=True)
class ExecutedAction:
    action: Action
    start: float
    end: float


@dataclasses.dataclass
class RunResult:
    losses: dict[int, torch.Tensor]        # micro-batch -> loss (last stage only), detached
    outputs: dict[int, Any]                # micro-batch -> last stage's output (eval with return_outputs)
    peak_stashed: int                      # most micro-batches whose activations were held at once
    trace: list[ExecutedAction]            # compute actions with their times (perf_counter)


@dataclasses.dataclass
class _Stashed:
    inputs: list[torch.Tensor]             # the leaves the input gradients are taken of
    outputs: list[torch.Tensor]            # what backward starts from (the scaled loss on the last stage)
    output_grads: list[torch.Tensor] | None = None
    split: SplitBackward | None = None     # what I kept for W ([Note: split backward])
    handed: list[torch.Tensor] = dataclasses.field(default_factory=list)  # the input gradients I handed on


def _as_list(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    raise TypeError(f"a pipeline stage must return a tensor or a tuple of tensors, got {type(value).__name__}; "
                    "return the tensors the next stage needs (pack other values into tensors)")


def _pack(tensors: list[torch.Tensor], was_tuple: bool) -> Any:
    return tuple(tensors) if was_tuple or len(tensors) != 1 else tensors[0]


class PipelineExecutor:
    """Runs a rank's actions; `pipe_ranks[r]` is the global rank of pipe rank r in this rank's pipe."""

    def __init__(self, module: PipelineModule, pipe_ranks: Sequence[int], *, timeout_s: float | None = None,
                 timeout_setting: str | None = None, clock: Callable[[], float] | None = None,
                 receive_ahead: bool = True, reuse_buffers: bool = True, fuse_backward: bool = True):
        import time

        self.module, self.pipe_ranks, self.timeout_s = module, list(pipe_ranks), timeout_s
        self.receive_ahead = receive_ahead
        # False: every receive allocates, every I and W run apart (the benchmark's baseline)
        self.reuse_buffers, self.fuse_backward = reuse_buffers, fuse_backward
        self.timeout_setting = timeout_setting  # where timeout_s came from, named by a timeout's error
        self.num_ranks = len(self.pipe_ranks)
        # which rank holds which stage (schedule.stage_to_rank); "loop" for a module that does not say
        self.placement: str = getattr(module, "stage_placement", "loop")
        self.last_stage = module.total_stages - 1
        self.clock = clock or time.perf_counter
        self._stage_params: dict[int, list[torch.nn.Parameter]] = {}
        self.pool = _BufferPool()  # [Note: receive buffer pool]
        self.failed: str | None = None  # why a run failed: the messages are out of step after it

    @property
    def device(self) -> torch.device:
        """The rank's device: inputs and labels are moved there."""
        return p2p.header_device()

    def _neighbour_ranks(self) -> list[int]:
        """The global ranks this rank exchanges messages with: those holding the stage before or after
        each of its stages (with interleaving, the last pipe rank's stage feeds the first's next one)."""
        total = self.module.total_stages
        mine = [s for s in range(total) if self.rank_of(s) == self.module.stage_id]
        me = self.pipe_ranks[self.module.stage_id]
        return sorted({self._global_rank(t) for s in mine for t in (s - 1, s + 1) if 0 <= t < total} - {me})

    def rank_of(self, stage: int) -> int:
        """The pipe rank that holds `stage`."""
        return stage_to_rank(stage, self.num_ranks, self.placement)

    def _global_rank(self, stage: int) -> int:
        return self.pipe_ranks[self.rank_of(stage)]

    def stage_parameters(self, stage: int) -> list[torch.nn.Parameter]:
        if stage not in self._stage_params:
            seen: dict[int, torch.nn.Parameter] = {}
            for child in self.module.stage_modules(stage):
                for p in child.parameters():
                    if p.requires_grad:
                        seen.setdefault(id(p), p)
            self._stage_params[stage] = list(seen.values())
        return self._stage_params[stage]

    def run(self, actions: Sequence[Action], *, inputs: Sequence[Any] | None, labels: Sequence[Any] | None,
            loss_scale: float = 1.0, train: bool = True, after_backward: Callable[[], None] | None = None,
            keep_outputs: bool = False, sharding: Callable[[Action], None] | None = None) -> RunResult:
        if self.failed is not None:
            raise PipelineError(f"this pipeline's earlier run failed ({self.failed}); messages between its stages are "
                                "out of step now and its receives posted ahead still pending, so it cannot run again: restart "
                                "the processes (zerodist run --max-restarts resumes from the last checkpoint)")
        run = _Run(self, inputs, labels, loss_scale, train, after_backward or (lambda: None), keep_outputs,
                   sharding or (lambda action: None))
        if self.fuse_backward:
            actions = fuse_split_backward(actions)
        try:
            run.inbox.post(actions)
            for action in actions:
                run.inbox.poll()
                with timeline.pipe_action(action.kind.value, action.stage, action.microbatch):
                    run.do(action)
            with timeline.span("pipe", "wait sends"):
                for handle in run.sends:
                    handle.wait(self.timeout_s, self.timeout_setting)
            if run.pooled:
                self.pool.end_run()
        except BaseException as error:
            self.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            for neighbour in self._neighbour_ranks():
                p2p.send_abort(neighbour)
            raise
        return RunResult(run.losses, run.outputs, run.peak_stashed, run.trace)


class _Run:
    """One run's state: received tensors, stashed activations, pending sends."""

    def __init__(self, executor: PipelineExecutor, inputs: Sequence[Any] | None, labels: Sequence[Any] | None,
                 loss_scale: float, train: bool, after_backward: Callable[[], None], keep_outputs: bool,
                 sharding: Callable[[Action], None]):
        self.x, self.data, self.labels = executor, inputs, labels
        self.loss_scale, self.train, self.after_backward, self.keep_outputs = (loss_scale, train, after_backward,
                                                                              keep_outputs)
        self.sharding = sharding
        self.device = executor.device  # inputs and labels are moved to it
        self.received: dict[tuple[int, int], tuple[list[torch.Tensor], bool]] = {}  # (stage, mb) -> input
        self.grads_in: dict[tuple[int, int], list[torch.Tensor]] = {}               # output gradients
        self.grads_out: dict[tuple[int, int], list[torch.Tensor]] = {}              # input gradients
        self.stash: dict[tuple[int, int], _Stashed] = {}
        self.sent_outputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.lent: dict[tuple[int, int], list[torch.Tensor]] = {}  # pool buffers back once (stage, mb)'s backward is done
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Any] = {}
        self.sends: list[p2p.SendHandle] = []
        self.peak_stashed = 0
        self.trace: list[ExecutedAction] = []
        # training receives into the pool and gives back; evaluation allocates (its layers get the
        # received tensors themselves, which a kept output may still hold)
        self.pooled = train and executor.reuse_buffers
        self.inbox = _Inbox(self)

    def do(self, action: Action) -> None:
        kind, stage, mb = action.kind, action.stage, action.microbatch
        key = (stage, mb)
        if kind is Kind.RECV_F:
            self._recv_activation(stage, mb)
        elif kind is Kind.RECV_B:
            self._recv_gradient(stage, mb)
        elif kind is Kind.SEND_F:
            tensors = self.sent_outputs.pop(key)
            self.sends.append(p2p.send_message(tensors, self.x._global_rank(stage + 1),
                                               label=(_ACTIVATION, stage + 1, mb)))
        elif kind is Kind.SEND_B:
            self.sends.append(p2p.send_message(self.grads_out.pop(key), self.x._global_rank(stage - 1),
                                               label=(_GRADIENT, stage - 1, mb)))
        elif kind.is_sharding:
            self.sharding(action)
        else:
            start = self.x.clock()
            {Kind.F: self._forward, Kind.B: self._backward, Kind.I: self._input_grad,
             Kind.W: self._weight_grad}[kind](stage, mb)
            self.trace.append(ExecutedAction(action, start, self.x.clock()))

    # ------------------------------------------------------------------ messages
    def _recv_activation(self, stage: int, mb: int) -> None:
        tensors = self.inbox.take(Kind.RECV_F, stage, mb)
        self.received[(stage, mb)] = (tensors, len(tensors) > 1)
        if self.train:  # floating ones are only leaves once F cloned them
            self.lent.setdefault((stage, mb), []).extend(t for t in tensors if t.is_floating_point())

    def _recv_gradient(self, stage: int, mb: int) -> None:
        grads = self.inbox.take(Kind.RECV_B, stage, mb)
        self.stash[(stage, mb)].output_grads = grads
        self.lent.setdefault((stage, mb), []).extend(grads)

    def _give_back(self, stage: int, mb: int, in_use: Sequence[torch.Tensor]) -> None:
        """(stage, mb)'s backward is done: its received buffers go back to the pool, but for any whose
        storage `in_use` (what the backward handed on) or a parameter's gradient still holds."""
        lent = self.lent.pop((stage, mb), None)
        if not lent:
            return
        if not self.x.reuse_buffers:
            return
        held = {t.untyped_storage().data_ptr() for t in in_use}
        held.update(p.grad.untyped_storage().data_ptr() for p in self.x.stage_parameters(stage) if p.grad is not None)
        self.x.pool.give([t for t in lent if t.untyped_storage().data_ptr() not in held])

    def incoming(self, kind: Kind, stage: int, mb: int) -> p2p.IncomingMessage:
        """The receive of RECV_F / RECV_B (stage, mb), posted now."""
        if kind is Kind.RECV_F:
            source, label = stage - 1, (_ACTIVATION, stage, mb)
            describe = f"the activation of micro-batch {mb} for stage {stage} from stage {source}"
        else:
            source, label = stage + 1, (_GRADIENT, stage, mb)
            describe = f"the output gradient of micro-batch {mb} for stage {stage} from stage {source}"
        return p2p.IncomingMessage(self.x._global_rank(source), label=label, describe=describe,
                                   timeout_s=self.x.timeout_s, timeout_setting=self.x.timeout_setting,
                                   allocate=self.x.pool.take if self.pooled else None)

    def expected(self, kind: Kind, stage: int, mb: int) -> tuple[bool, list[p2p.Meta] | None]:
        """(known, metas): an output gradient must match the output it is the gradient of, known
        once F(stage, mb) ran; an activation's shape is the sender's to say."""
        if kind is Kind.RECV_F:
            return True, None
        stashed = self.stash.get((stage, mb))
        if stashed is None:
            return False, None
        return True, [(tuple(t.shape), t.dtype) for t in stashed.outputs if t.is_floating_point()]

    # ------------------------------------------------------------------ compute
    def _stage_input(self, stage: int, mb: int) -> tuple[Any, list[torch.Tensor]]:
        if stage == 0:
            if self.data is None:
                raise RuntimeError("the first pipeline stage needs the micro-batches' inputs")
            value = _on(self.data[mb], self.device)
            return value, [t for t in _leaves(value) if t.is_floating_point() and t.requires_grad]
        tensors, was_tuple = self.received.pop((stage, mb))
        leaves = []
        for index, tensor in enumerate(tensors):
            if tensor.is_floating_point() and self.train:
                leaf = tensor.detach().requires_grad_(True)
                leaves.append(leaf)
                # The layers get a copy, so a first layer that works in place (ReLU(inplace=True))
                # does not write into the leaf its gradient is taken of (DeepSpeed clones too).
                tensors[index] = leaf.clone()
        return _pack(tensors, was_tuple), leaves

    def _forward(self, stage: int, mb: int) -> None:
        value, leaves = self._stage_input(stage, mb)
        with torch.set_grad_enabled(self.train):
            output = self.x.module(value, stage=stage)
            if stage == self.x.last_stage:
                self._finish_last_stage(stage, mb, output, leaves)
                return
        tensors = _as_list(output)
        if self.train:
            self.stash[(stage, mb)] = _Stashed(leaves, tensors)
            self.peak_stashed = max(self.peak_stashed, len(self.stash))
        if self.x.rank_of(stage + 1) == self.x.rank_of(stage):
            # the next stage is on this rank: hand over in memory, as a message would
            self.received[(stage + 1, mb)] = ([t.detach() for t in tensors], isinstance(output, tuple))
        else:
            self.sent_outputs[(stage, mb)] = tensors

    def _finish_last_stage(self, stage: int, mb: int, output: Any, leaves: list[torch.Tensor]) -> None:
        loss_fn = self.x.module.loss_fn
        if self.keep_outputs:
            self.outputs[mb] = output.detach() if isinstance(output, torch.Tensor) else output
        if loss_fn is None:
            loss = output
        elif self.labels is None:
            raise RuntimeError("the last pipeline stage needs the micro-batches' labels")
        else:
            loss = loss_fn(output, _on(self.labels[mb], self.device))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("the last pipeline stage must produce a scalar loss: give PipelineModule a loss_fn, "
                             f"or make the last layer return one (got {type(loss).__name__} "
                             f"{tuple(getattr(loss, 'shape', ()))})")
        self.losses[mb] = loss.detach()
        if self.train:
            # at least fp32 (a bf16 loss scaled in bf16 would round); an fp64 loss stays fp64
            scaled = loss.to(torch.promote_types(loss.dtype, torch.float32)) * self.loss_scale
            self.stash[(stage, mb)] = _Stashed(leaves, [scaled])
            self.peak_stashed = max(self.peak_stashed, len(self.stash))

    def _backward_roots(self, stashed: _Stashed) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if stashed.output_grads is None:  # the last stage: the scaled loss
            return stashed.outputs, None
        floating = [t for t in stashed.outputs if t.is_floating_point()]
        pairs = [(t, g) for t, g in zip(floating, stashed.output_grads) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _input_grads(self, stashed: _Stashed) -> list[torch.Tensor]:
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in stashed.inputs]

    def _backward(self, stage: int, mb: int) -> None:
        stashed = self.stash.pop((stage, mb))
        roots, grads = self._backward_roots(stashed)
        if roots:
            torch.autograd.backward(roots, grads)
        self.after_backward()
        input_grads = self._input_grads(stashed)
        self._hand_input_grads(stage, mb, input_grads)
        self._give_back(stage, mb, input_grads)

    def _input_grad(self, stage: int, mb: int) -> None:
        stashed = self.stash[(stage, mb)]
        if not stashed.inputs:
            return  # the first stage: no input gradient to compute; W does the whole backward
        roots, grads = self._backward_roots(stashed)
        computed, stashed.split = input_backward(roots, grads, stashed.inputs)
        stashed.outputs, stashed.output_grads = [], None  # W starts from what I kept
        stashed.handed = [g if g is not None else torch.zeros_like(t) for g, t in zip(computed, stashed.inputs)]
        self._hand_input_grads(stage, mb, stashed.handed)

    def _weight_grad(self, stage: int, mb: int) -> None:
        stashed = self.stash.pop((stage, mb))
        params = self.x.stage_parameters(stage)
        if stashed.split is not None:
            weight_backward(stashed.split, params)
        else:
            roots, grads = self._backward_roots(stashed)
            if roots and params:
                torch.autograd.backward(roots, grads, inputs=params)
        self.after_backward()
        self._give_back(stage, mb, stashed.handed)

    def _hand_input_grads(self, stage: int, mb: int, grads: list[torch.Tensor]) -> None:
        if stage == 0:
            return
        if self.x.rank_of(stage - 1) == self.x.rank_of(stage):
            self.stash[(stage - 1, mb)].output_grads = grads
        else:
            self.grads_out[(stage, mb)] = grads


class _Inbox:
    """A run's incoming messages ([Note: receives posted ahead] in zerodist/comm/p2p.py): every
    header receive posted at the start in the schedule's order (per source, the order the sender
    sends: `schedule_checks.check_message_order`), each opened (checked, payload receive posted) by
    `poll()` as soon as it is there, and in any case by `take()` at its RECV."""

    def __init__(self, run: _Run):
        self.run = run
        self.messages: dict[tuple[Kind, int, int], p2p.IncomingMessage] = {}
        self.unopened: dict[int, deque[tuple[tuple[Kind, int, int], p2p.IncomingMessage]]] = {}

    def post(self, actions: Sequence[Action]) -> None:
        if not (self.run.x.receive_ahead and p2p.posts_ahead()):
            return
        for action in actions:
            if action.kind.is_recv:
                key = (action.kind, action.stage, action.microbatch)
                message = self.run.incoming(*key)
                self.messages[key] = message
                self.unopened.setdefault(message.src, deque()).append((key, message))

    def poll(self) -> None:
        """Open, in order per source, the messages whose headers are there (never waits)."""
        for queue in self.unopened.values():
            while queue and queue[0][1].header_arrived():
                key, message = queue[0]
                known, expect = self.run.expected(*key)
                if not known:
                    break
                message.open(expect)
                queue.popleft()

    def take(self, kind: Kind, stage: int, mb: int) -> list[torch.Tensor]:
        """The tensors of RECV `kind` (stage, mb): waits (up to the timeout) for what is not there."""
        key = (kind, stage, mb)
        _, expect = self.run.expected(*key)
        message = self.messages.pop(key, None)
        if message is None:  # not posted ahead
            return self.run.incoming(*key).tensors(expect)
        queue = self.unopened[message.src]
        if queue and queue[0][1] is message:
            queue.popleft()
        # the earlier messages from this source were taken (so opened) before: RECVs come in send order
        assert all(m is not message for _, m in queue), f"{key} taken out of its source's order"
        return message.tensors(expect)


_PoolKey = tuple[tuple[int, ...], torch.dtype, torch.device]


class _BufferPool:
    """Receive buffers kept across micro-batches and runs ([Note: receive buffer pool]). Only what
    `take` handed out is taken back by `give` (an inline message's fresh tensor is not), and
    `end_run` keeps, per shape, as many buffers as the run had out at once."""

    def __init__(self) -> None:
        self.free: dict[_PoolKey, list[torch.Tensor]] = {}
        self.allocated = 0  # buffers made (the pool's high-water mark), for tests
        # the buffers out now, by storage address (weak: one never given back goes when its holders do)
        self._out: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._in_use: dict[_PoolKey, int] = {}  # this run's buffers out now, per key
        self._peak: dict[_PoolKey, int] = {}    # this run's most buffers out at once, per key

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (tuple(shape), dtype, device)
        free = self.free.get(key)
        if free:
            tensor = free.pop()
        else:
            self.allocated += 1
            tensor = torch.empty(shape, dtype=dtype, device=device)
        self._out[tensor.untyped_storage().data_ptr()] = tensor
        self._in_use[key] = self._in_use.get(key, 0) + 1
        self._peak[key] = max(self._peak.get(key, 0), self._in_use[key])
        return tensor

    def give(self, tensors: Sequence[torch.Tensor]) -> None:
        """Take back those of `tensors` that `take` handed out (others are ignored)."""
        for tensor in tensors:
            ptr = tensor.untyped_storage().data_ptr()
            if self._out.get(ptr) is not tensor:
                continue
            del self._out[ptr]
            key = (tuple(tensor.shape), tensor.dtype, tensor.device)
            self._in_use[key] = max(0, self._in_use.get(key, 0) - 1)
            self.free.setdefault(key, []).append(tensor)

    def end_run(self) -> None:
        """A run that received into the pool is over: keep per shape only as many free buffers as it
        had out at once (none of a shape it did not receive), so shapes that change between steps and
        buffers never given back do not pile up."""
        for key in list(self.free):
            keep = self._peak.get(key, 0)
            if keep:
                del self.free[key][keep:]
            else:
                del self.free[key]
        self._in_use.clear()
        self._peak.clear()
        self._out = weakref.WeakValueDictionary()

    @property
    def free_count(self) -> int:
        return sum(len(buffers) for buffers in self.free.values())

    @property
    def free_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for buffers in self.free.values() for t in buffers)

    def clear(self) -> None:
        """Drop the free buffers (between runs: a later receive allocates again)."""
        self.free.clear()


def _on(value: Any, device: torch.device) -> Any:
    """`value` (a tensor, or tuples, lists and dicts of them) with its tensors on `device`."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_on(v, device) for v in value)
    if isinstance(value, dict):
        return {key: _on(v, device) for key, v in value.items()}
    return value


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _leaves(v)]
    return []
