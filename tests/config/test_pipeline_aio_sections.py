"""DeepSpeed's "pipeline" and "aio" config sections: accepted with one info line naming the keys that
change nothing here (the pipeline's activation-checkpoint keys are kept), refused naming the key otherwise."""

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
        config = zerodist.Config.load({"train_batch_size": 2, "pipeline": PIPELINE, "aio": AIO})
    finally:
        root.removeHandler(handler)
    lines = [line for line in handler.lines if "change nothing in zerodist" in line]
    assert len(lines) == 1 and "pipeline.stages=" in lines[0] and "aio=" in lines[0]
    # the activation-checkpoint keys mean something here (zerodist/pipe/module.py): kept, not in the line
    assert "activation_checkpoint_interval" not in lines[0] and "use_reentrant" not in lines[0]
    assert config.pipeline.activation_checkpoint_interval == 0 and config.pipeline.use_reentrant is True


@pytest.mark.parametrize("section, value, message", [
    ("pipeline", {"stagez": 2}, "unknown key 'pipeline.stagez' \\(did you mean 'stages'"),
    ("aio", {"block_size": 1, "threads": 2}, "unknown key 'aio.threads' \\(did you mean 'thread_count'")])
def test_an_unknown_key_in_them_is_refused_naming_it(section, value, message):
    with pytest.raises(zerodist.ConfigError, match=message):
        zerodist.Config.load({"train_batch_size": 2, section: value})


@pytest.mark.parametrize("value, message", [
    ({"block_size": "1M"}, "'aio.block_size': got \"1M\"; expected an integer >= 1"),
    ({"queue_depth": 0}, "'aio.queue_depth': got 0; expected an integer >= 1"),
    ({"intra_op_parallelism": -2}, "'aio.intra_op_parallelism': got -2"),
    ({"thread_count": 2.5}, "'aio.thread_count': got 2.5"),
    ({"single_submit": 1}, "'aio.single_submit': got 1; expected true or false"),
    ({"overlap_events": "true"}, "'aio.overlap_events'"),
    ({"use_gds": None}, "'aio.use_gds'")])
def test_an_aio_value_of_the_wrong_type_is_refused_naming_the_key(value, message):
    """zerodist ignores the aio section, but not a value DeepSpeed's schema would refuse (it passed before)."""
    with pytest.raises(zerodist.ConfigError, match=message):
        zerodist.Config.load({"train_batch_size": 2, "aio": {**AIO, **value}})


def test_the_aio_keys_dropped_are_the_aio_sections_fields():
    from zerodist.config.deepspeed_keys import AIO_KEYS
    from zerodist.config.offload_sections import AioConfig

    assert AIO_KEYS == set(AioConfig.model_fields)
