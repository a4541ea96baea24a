"""Layer 8: the training loop behind `zerodist train` (a byte-level GPT on the stdlib corpus).

`TrainPlan` says what to train (built from defaults, a DeepSpeed JSON file and flags by
`merge_config`); `train(plan)` runs it on this rank and reports on rank 0.
"""

from zerodist.train.options import Overrides, TrainPlan, default_config, merge_config

__all__ = ["Overrides", "TrainPlan", "default_config", "merge_config", "train"]


def train(plan: TrainPlan) -> int:
    """Run `plan` on this rank (imports torch and the engine only when called)."""
    if plan.pipe > 1:
        from zerodist.train.pipeline import train_pipeline

        return train_pipeline(plan)
    from zerodist.train.loop import train as run

    return run(plan)
