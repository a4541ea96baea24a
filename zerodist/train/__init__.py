"""Layer 8: the training loop behind `zerodist train` (a byte-level GPT on the stdlib corpus).

`TrainPlan` says what to train (built from defaults, a DeepSpeed JSON file and flags by
`merge_config`); `train(plan, progress)` runs it on this rank and returns a `TrainOutcome`: the
exit code and rank 0's report, which the CLI prints (zerodist/cli/train.py; nothing here prints).
"""

from zerodist.train.options import Overrides, Progress, TrainOutcome, TrainPlan, default_config, merge_config

__all__ = ["Overrides", "Progress", "TrainOutcome", "TrainPlan", "default_config", "merge_config", "train"]


def train(plan: TrainPlan, progress: Progress | None = None) -> TrainOutcome:
    """Run `plan` on this rank (imports torch and the engine only when called); rank 0's lines
    that belong before or during the run go to `progress`. A pipeline (`plan.pipe > 1`) is the
    same loop over the GPT cut by `zerodist.pipe.split_model`."""
    from zerodist.train.loop import train as run

    return run(plan, progress)
