"""The DeepSpeed module paths `test_ulysses.py` imports: `deepspeed.module_inject.tp_shard` (DeepSpeed's head split,
computed as DeepSpeed computes it) and `deepspeed.sequence.fpdt_layer` (FPDT, not implemented: refused on use, never
a stand-in)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zerodist.runtime import fpdt_layer
from zerodist.runtime.module_inject import tp_shard

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def kv_heads():
    yield tp_shard.set_num_kv_heads
    tp_shard.set_num_kv_heads(None)


@pytest.mark.unit
def test_shard_sizes_follow_deepspeeds_rule(kv_heads):
    # No head count: near-even, the first ranks taking one more (the uneven-heads all-to-all's split).
    assert tp_shard.get_shard_size_list(7, 2) == [4, 3]
    assert tp_shard.get_shard_size_list(7, 4) == [2, 2, 2, 1]
    assert tp_shard.get_shard_size(3, 2, rank=1) == 1
    # A key/value head count dividing the size: whole heads dealt out (8 heads of 2 over 3 ranks).
    kv_heads(8)
    assert tp_shard.get_num_kv_heads() == 8
    assert tp_shard.get_shard_size_list(16, 3) == [6, 6, 4]
    # ... except for the last linear layers and MLPs, split near-evenly as in DeepSpeed.
    assert tp_shard.get_shard_size_list(16, 3, name="lm_head") == [6, 5, 5]
    assert tp_shard.get_shard_size_list(16, 3, name="mlp.up_proj") == [6, 5, 5]
    with pytest.raises(ValueError, match="group-local rank or process group"):
        tp_shard.get_shard_size(16, 3)  # no rank, and the world (1 process) is not the group


@pytest.mark.unit
def test_fpdt_is_refused_on_use_naming_the_alternative():
    with pytest.raises(NotImplementedError, match=r"FPDT.*not implemented by zerodist.*ulysses"):
        fpdt_layer.FPDT_InputConstruct(None, None, None, None, None, None, 2, 0)
    with pytest.raises(NotImplementedError, match=r"_FPDTGPUOffloadingAttentionImpl_.apply"):
        fpdt_layer._FPDTGPUOffloadingAttentionImpl_.apply(None)


def test_served_paths_import_and_autotp_stays_refused():
    from zerodist.integrations.as_deepspeed import environment

    code = textwrap.dedent("""
        from deepspeed.module_inject.tp_shard import get_shard_size_list
        from deepspeed.sequence.fpdt_layer import _FPDTGPUOffloadingAttentionImpl_, FPDT_InputConstruct
        assert get_shard_size_list(7, 2) == [4, 3]
        import deepspeed.module_inject
        try:
            deepspeed.module_inject.replace_transformer_layer
        except AttributeError as error:
            assert "autotp_size" in str(error), error
        else:
            raise AssertionError("AutoTP served")
        try:
            import deepspeed.module_inject.auto_tp
        except ModuleNotFoundError as error:
            assert "autotp_size" in str(error), error
        else:
            raise AssertionError("AutoTP served")
        print("ok")
    """)
    env = environment({**os.environ, "PYTHONPATH": str(REPO)})
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
