"""``deepspeed.runtime.pipe.schedule``: DeepSpeed's pipeline schedules as instruction streams.

A schedule for one stage yields, step by step, the list of instructions that stage runs
(``LoadMicroBatch``, ``ForwardPass``, ``SendActivation``, ...), each naming the activation buffer it
uses. ``TrainSchedule`` is DeepSpeed's 1F1B: forwards on one parity of steps and backwards on the
other, so neighbouring stages always exchange in matching pairs; ``InferenceSchedule`` is
forward-only with two alternating buffers. These follow DeepSpeed's step arithmetic exactly, so
code written against them (and DeepSpeed's own schedule tests) sees the same streams.
zerodist's engine runs its own schedules (``zerodist.pipe.schedule``: actions per rank, checked
and simulated); these classes do not drive it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["BackwardPass", "BufferOpInstruction", "DataParallelSchedule", "ForwardPass", "InferenceSchedule",
           "LoadMicroBatch", "OptimizerStep", "PipeInstruction", "PipeSchedule", "RecvActivation", "RecvGrad",
           "ReduceGrads", "ReduceTiedGrads", "SendActivation", "SendGrad", "TrainSchedule"]


class PipeSchedule:
    """The instructions of stage `stage_id` of `stages` over `micro_batches` micro-batches."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        self.micro_batches, self.stages, self.stage_id = micro_batches, stages, stage_id
        self.prev_stage, self.next_stage = stage_id - 1, stage_id + 1
        self.it: Iterator[list[PipeInstruction]] | None = None

    def steps(self) -> Iterator[list[PipeInstruction]]:
        raise NotImplementedError

    def num_pipe_buffers(self) -> int:
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def _buffer_idx(self, micro_batch_id: int) -> int:
        return micro_batch_id % self.num_pipe_buffers()

    def __iter__(self) -> PipeSchedule:
        self.it = None
        return self

    def __next__(self) -> list[PipeInstruction]:
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


class InferenceSchedule(PipeSchedule):
    """Forward only; even stages send before they receive, odd stages the reverse, over two buffers."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches + self.stages - 1):
            micro_batch_id = step_id - self.stage_id
            even = self.stage_id % 2 == 0
            recv_buf, send_buf = (step_id % 2, (step_id + 1) % 2) if even else ((step_id + 1) % 2, step_id % 2)
            cmds: list[PipeInstruction] = []
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(micro_batch_id):
                cmds.append(LoadMicroBatch(recv_buf))
            send = self._valid_stage(self.next_stage) and self._valid_micro_batch(micro_batch_id - 1)
            recv = self._valid_stage(self.prev_stage) and self._valid_micro_batch(micro_batch_id)
            exchange = [SendActivation(send_buf)] * send + [RecvActivation(recv_buf)] * recv
            cmds.extend(exchange if even else exchange[::-1])
            if self._valid_micro_batch(micro_batch_id):
                cmds.append(ForwardPass(recv_buf))
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 2


class TrainSchedule(PipeSchedule):
    """DeepSpeed's 1F1B training schedule; the last step reduces gradients and steps the optimizer."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        prev_micro_batch_id, prev_buffer, curr_buffer = -1, 0, 0
        total_steps = 2 * (self.micro_batches + self.stages - 1)
        for step_id in range(total_steps):
            micro_batch_id, is_forward = self._step_to_micro_batch(step_id)
            if self._valid_micro_batch(prev_micro_batch_id):
                prev_buffer = self._buffer_idx(prev_micro_batch_id)
            if self._valid_micro_batch(micro_batch_id):
                curr_buffer = self._buffer_idx(micro_batch_id)
            valid_prev, valid_curr = self._valid_micro_batch(prev_micro_batch_id), self._valid_micro_batch(micro_batch_id)
            cmds: list[PipeInstruction] = []
            if is_forward:
                if valid_prev and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(prev_buffer))
                if valid_curr and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(curr_buffer))
            else:
                if valid_curr and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(curr_buffer))
                if valid_prev and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(prev_buffer))
            if (self.is_first_stage or self.is_last_stage) and is_forward and valid_curr:
                cmds.append(LoadMicroBatch(curr_buffer))
            if valid_curr:
                cmds.append(ForwardPass(curr_buffer) if is_forward else BackwardPass(curr_buffer))
            if step_id == total_steps - 1:
                cmds.extend([ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
            prev_micro_batch_id = micro_batch_id
            yield cmds

    def num_pipe_buffers(self) -> int:
        """In-flight micro-batches: at most the stages after this one, at least two."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def _step_to_micro_batch(self, step_id: int) -> tuple[int, bool]:
        even_step, even_stage = step_id % 2 == 0, self.stage_id % 2 == 0
        if even_step == even_stage:  # this stage's forward steps
            return (step_id if even_step else step_id - 1) // 2 - self.stage_id // 2, True
        if even_step:  # odd stage, backward
            return step_id // 2 - self.stages + (self.stage_id + 1) // 2, False
        return (step_id - 1) // 2 - self.stages + 1 + self.stage_id // 2, False


class DataParallelSchedule(PipeSchedule):
    """One stage: load, forward, backward per micro-batch, then reduce and step."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0),
                                           BackwardPass(buffer_id=0)]
            if step_id == self.micro_batches - 1:
                cmds.extend([ReduceGrads(), OptimizerStep()])
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1


class PipeInstruction:
    """One instruction of a schedule; its keyword arguments are attributes."""

    def __init__(self, **kwargs: Any) -> None:
        self.name = self.__class__.__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        arguments = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({arguments})"


class OptimizerStep(PipeInstruction):
    """Step the optimizer (after the gradients are reduced)."""


class ReduceGrads(PipeInstruction):
    """Reduce the gradients over the data-parallel ranks of this stage."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the gradients of tied modules over the stages that hold them."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on activation buffer `buffer_id`."""

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Read the next micro-batch into the buffer (first stage: inputs; last stage: labels)."""


class ForwardPass(BufferOpInstruction):
    """Compute this stage's forward of the buffer's input."""


class BackwardPass(BufferOpInstruction):
    """Compute this stage's backward of the buffer's output."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's output to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's output into the buffer."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of the buffer's input to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of the buffer's output from the next stage."""
