"""DeepSpeed's `csv_monitor` and `tensorboard` config sections: per-step scalars from rank 0.

Event names and file layout follow DeepSpeed's monitors, so existing tooling keeps working:
`Train/Samples/train_loss`, `Train/Samples/lr` and `Train/Samples/loss_scale`, with the number
of samples seen as the step (`loss_scale` only under fp16, as DeepSpeed writes it); the CSV monitor writes one file per event,
`<output_path>/<job_name>/Train_Samples_train_loss.csv` with a `step,<event>` header.
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


class Monitors:
    """The monitors the config enables; `write()` on rank 0 only (the caller decides)."""

    def __init__(self, config: Config):
        self.monitors: list[Any] = []
        self.loss_scaling = bool(config.fp16.enabled)  # DeepSpeed writes loss_scale only under fp16
        if config.csv_monitor.enabled:
            self.monitors.append(CsvMonitor(config.csv_monitor.output_path, config.csv_monitor.job_name))
        if config.tensorboard.enabled:
            self.monitors.append(TensorboardMonitor(config.tensorboard.output_path, config.tensorboard.job_name))

    def __bool__(self) -> bool:
        return bool(self.monitors)

    def write(self, samples: int, *, loss: float, lr: float, loss_scale: float) -> None:
        scalars = {"Train/Samples/train_loss": loss, "Train/Samples/lr": lr}
        if self.loss_scaling:
            scalars["Train/Samples/loss_scale"] = loss_scale
        for monitor in self.monitors:
            monitor.write(samples, scalars)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
