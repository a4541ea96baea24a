"""The unknown-key policy: refused by default; with the explicit opt-in (`ZERODIST_UNKNOWN_KEYS=warn` or
`"zerodist": {"unknown_keys": "warn"}`) a key DeepSpeed ignores is dropped with one rank-0 warning that
keeps the "did you mean", and one DeepSpeed refuses (or acts on) is still refused."""

from __future__ import annotations


import pytest

from zerodist.config import Config, ConfigError
from zerodist.config import unknown_keys

from tests.engine_helpers import zerodist_log

pytestmark = pytest.mark.unit

# DeepSpeed's own tests/unit/runtime/pipe/test_pipe.py writes this key.
MISSPELT = {"train_batch_size": 4, "grandient_accumulation_steps": 1, "steps_per_print": 20}


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(unknown_keys.ENV_VAR, raising=False)
    monkeypatch.setattr(unknown_keys, "_warned", set())


def test_refused_by_default() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'grandient_accumulation_steps' \(did you mean "
                                          r"'gradient_accumulation_steps'\?\)"):
        Config.load(MISSPELT)


@pytest.mark.parametrize("opt_in", ["env", "config"])
def test_warn_drops_the_key_as_deepspeed_does(monkeypatch: pytest.MonkeyPatch, opt_in: str) -> None:
    raw = dict(MISSPELT)
    if opt_in == "env":
        monkeypatch.setenv(unknown_keys.ENV_VAR, "warn")
    else:
        raw["zerodist"] = {"unknown_keys": "warn"}
    with zerodist_log() as messages:
        config = Config.load(raw)
        Config.load(raw)  # a second load (the Trainer and the engine both read it) warns no more
    # DeepSpeed's meaning: the key is not there, so accumulation is derived (4 / micro / world).
    assert config.to_dict() == Config.load({k: v for k, v in raw.items() if k != "grandient_accumulation_steps"}
                                           ).to_dict()
    warnings = [m for m in messages if "grandient_accumulation_steps" in m]
    assert len(warnings) == 1
    assert "did you mean 'gradient_accumulation_steps'?" in warnings[0] and "ignored" in warnings[0]


def test_warn_only_on_rank0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(unknown_keys.ENV_VAR, "warn")
    monkeypatch.setenv("RANK", "1")
    with zerodist_log() as messages:
        Config.load(MISSPELT)
    assert not [m for m in messages if "grandient" in m]


def test_warn_ignores_only_where_deepspeed_ignores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(unknown_keys.ENV_VAR, "warn")
    optimizer = {"type": "Adam", "params": {"lr": 1e-3}, "tipe": "x"}
    assert Config.load({**MISSPELT, "optimizer": optimizer}).optimizer is not None
    # DeepSpeed's pydantic sections refuse unknown keys too: still an error, with the other problems.
    with pytest.raises(ConfigError, match=r"unknown key 'zero_optimization.stag' \(did you mean 'stage'\?\)"):
        Config.load({**MISSPELT, "zero_optimization": {"stag": 1}})
    with pytest.raises(ConfigError, match="unknown key 'zerodist.timout'"):
        Config.load({**MISSPELT, "zerodist": {"timout": 5}})
    # A DeepSpeed key zerodist does not implement: DeepSpeed would act on it, so it is not dropped.
    with pytest.raises(ConfigError, match="'hybrid_engine' is a DeepSpeed setting that zerodist does not"):
        Config.load({**MISSPELT, "hybrid_engine": {"enabled": True}})


def test_bad_policy_values(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"'zerodist.unknown_keys': got \"wern\""):
        Config.load({**MISSPELT, "zerodist": {"unknown_keys": "wern"}})
    monkeypatch.setenv(unknown_keys.ENV_VAR, "yes")
    with pytest.raises(ConfigError, match="ZERODIST_UNKNOWN_KEYS='yes': give 'error'"):
        Config.load({"train_batch_size": 4})


def test_the_config_key_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(unknown_keys.ENV_VAR, "warn")
    with pytest.raises(ConfigError, match="grandient"):
        Config.load({**MISSPELT, "zerodist": {"unknown_keys": "error"}})
