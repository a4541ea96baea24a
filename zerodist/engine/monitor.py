"""DeepSpeed's `csv_monitor`, `tensorboard`, `wandb` and `comet` config sections: per-step scalars
from rank 0.

Event names and file layout follow DeepSpeed's monitors, so existing tooling keeps working:
`Train/Samples/train_loss`, `Train/Samples/lr` and `Train/Samples/loss_scale`, with the number
of samples seen as the step (`loss_scale` only under fp16, as DeepSpeed writes it); the CSV monitor writes one file per event,
`<output_path>/<job_name>/Train_Samples_train_loss.csv` with a `step,<event>` header. W&B gets
`wandb.log({event: value}, step=samples)` in a run `wandb.init(project, group, entity=team)`
starts; Comet gets each event once `samples_log_interval` samples have passed since it last did, in
the experiment `comet_ml.start(...)` starts, as DeepSpeed's monitors do. The packages are imported
only when their section is enabled (and the config checks they are installed: monitor_sections.py).
"""

from __future__ import annotations

import csv
import os
from typing import Any

from zerodist.config import Config, ConfigError


class CsvMonitor:
    def __init__(self, output_path: str, job_name: str):
        self.folder = os.path.join(output_path or "csv_monitor", job_name)
        os.makedirs(self.folder, exist_ok=True)
        self._files: dict[str, Any] = {}

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for event, value in scalars.items():
            handle = self._files.get(event)
            if handle is None:
                path = os.path.join(self.folder, event.replace("/", "_") + ".csv")
                is_new = not os.path.exists(path)
                handle = self._files[event] = open(path, "a", newline="")
                if is_new:
                    csv.writer(handle).writerow(["step", event])
            csv.writer(handle).writerow([step, value])
            handle.flush()

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()


class TensorboardMonitor:
    def __init__(self, output_path: str, job_name: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # the tensorboard package is optional
            raise ConfigError("'tensorboard.enabled' needs the tensorboard package: pip install tensorboard") from err
        self.writer = SummaryWriter(log_dir=os.path.join(output_path or "runs", job_name))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for event, value in scalars.items():
            self.writer.add_scalar(event, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbMonitor:
    def __init__(self, settings: Any):
        try:
            import wandb  # type: ignore[import-not-found,unused-ignore]  # optional: zerodist[monitors]
        except ImportError as err:  # the config checked; an install broken past find_spec still says so
            raise ConfigError("'wandb.enabled' needs the wandb package: pip install wandb") from err
        self.run = wandb.init(project=settings.project, group=settings.group, entity=settings.team)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for event, value in scalars.items():
            self.run.log({event: value}, step=step)

    def close(self) -> None:
        self.run.finish()


class CometMonitor:
    def __init__(self, settings: Any):
        try:
            import comet_ml  # type: ignore[import-not-found,unused-ignore]  # optional: zerodist[monitors]
        except ImportError as err:
            raise ConfigError("'comet.enabled' needs the comet_ml package: pip install comet_ml") from err
        self.experiment = comet_ml.start(api_key=settings.api_key, project=settings.project,
                                         workspace=settings.workspace, experiment_key=settings.experiment_key,
                                         mode=settings.mode, online=settings.online)
        if settings.experiment_name is not None:
            self.experiment.set_name(settings.experiment_name)
        self.interval = settings.samples_log_interval
        self.logged_at: dict[str, int] = {}  # event -> the samples when it was last logged

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for event, value in scalars.items():
            last = self.logged_at.get(event)
            if last is None or step - last >= self.interval:
                self.logged_at[event] = step
                self.experiment.log_metric(event, value, step=step)

    def close(self) -> None:
        self.experiment.end()


class Monitors:
    """The monitors the config enables; `write()` on rank 0 only (the caller decides). W&B and Comet
    start a run, so they exist on rank 0 only (the others have none to write)."""

    def __init__(self, config: Config, rank: int = 0):
        self.monitors: list[Any] = []
        self.enabled = any(section.enabled for section in (config.csv_monitor, config.tensorboard, config.wandb,
                                                            config.comet))
        self.loss_scaling = bool(config.fp16.enabled)  # DeepSpeed writes loss_scale only under fp16
        if config.csv_monitor.enabled:
            self.monitors.append(CsvMonitor(config.csv_monitor.output_path, config.csv_monitor.job_name))
        if config.tensorboard.enabled:
            self.monitors.append(TensorboardMonitor(config.tensorboard.output_path, config.tensorboard.job_name))
        if config.wandb.enabled and rank == 0:
            self.monitors.append(WandbMonitor(config.wandb))
        if config.comet.enabled and rank == 0:
            self.monitors.append(CometMonitor(config.comet))

    def __bool__(self) -> bool:
        """Whether the config enables any monitor: the same on every rank (the loss written is agreed
        with a collective every rank joins), though only rank 0 holds W&B's run and Comet's experiment."""
        return self.enabled

    def write(self, samples: int, *, loss: float, lr: float, loss_scale: float) -> None:
        scalars = {"Train/Samples/train_loss": loss, "Train/Samples/lr": lr}
        if self.loss_scaling:
            scalars["Train/Samples/loss_scale"] = loss_scale
        self.write_scalars(samples, scalars)

    def write_scalars(self, samples: int, scalars: dict[str, float]) -> None:
        """Any events (wall_clock_breakdown's `Train/Samples/elapsed_time_ms_*`: engine/phase_timing.py)."""
        for monitor in self.monitors:
            monitor.write(samples, scalars)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
