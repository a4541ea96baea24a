"""DeepSpeed's "pipeline" and "aio" config sections: accepted with one info line when every key is
DeepSpeed's (they change nothing here), refused naming the section otherwise."""

from __future__ import annotations

import logging

import pytest

import zerodist

pytestmark = pytest.mark.unit

PIPELINE = {"stages": "auto", "partition": "best", "seed_layers": False, "activation_checkpoint_interval": 0,
            "pipe_partitioned": True, "grad_partitioned": True, "use_reentrant": True}
AIO = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False, "overlap_events": True,
       "use_gds": False}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_deepspeeds_pipeline_and_aio_sections_load_with_one_info_line():
    handler, root = _Lines(), logging.getLogger("zerodist")
    root.addHandler(handler)
    try:
        zerodist.Config.load({"train_batch_size": 2, "pipeline": PIPELINE, "aio": AIO})
    finally:
        root.removeHandler(handler)
    lines = [line for line in handler.lines if "change nothing in zerodist" in line]
    assert len(lines) == 1 and "pipeline=" in lines[0] and "aio=" in lines[0]


@pytest.mark.parametrize("section, value", [("pipeline", {"stagez": 2}), ("aio", {"block_size": 1, "threads": 2})])
def test_an_unknown_key_in_them_is_refused_naming_the_section(section, value):
    with pytest.raises(zerodist.ConfigError, match=f"'{section}' is a DeepSpeed setting"):
        zerodist.Config.load({"train_batch_size": 2, section: value})
