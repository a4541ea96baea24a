"""`zerodist train` restarted: a finished run exits 0 with one line, `--steps` below the
checkpoint is a named error, metrics.csv keeps the whole history across resumes, --keep-last.
The runs that are not killed run on the harness's pooled ranks as each launched rank runs them
(harness.run_cli): their subject is what the ranks do on a restart, not the launch."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.checkpoint_procs import launch
from tests.harness import run_cli

REPO = Path(__file__).resolve().parents[2]
COMMON = ("--model", "tiny", "--nproc", "1", "--save-interval", "2", "--keep-last", "1")


def _train(out: Path, *args: str):
    return run_cli(1, "train", *COMMON, "--out", str(out), *args, timeout=150)


def _zerodist(argv: list[str]) -> int:
    from zerodist.cli.main import main

    return main(argv)


def _rows(out: Path) -> list[tuple[int, str]]:
    with open(out / "metrics.csv", encoding="utf-8") as f:
        return [(int(r["step"]), r["loss"]) for r in csv.DictReader(f)]


def test_restarts_keep_the_history_and_never_fail_a_finished_run(tmp_path):
    out = tmp_path / "run"
    first = _train(out, "--steps", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["global_step4", "latest"]  # --keep-last 1
    four = _rows(out)
    assert [s for s, _ in four] == [1, 2, 3, 4]

    (out / "loss.png").unlink()  # as if killed after the final save, before the plot
    again = _train(out, "--steps", "4", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip().splitlines() == [
        f"zerodist train: nothing left to train: the checkpoint in {out / 'checkpoints'} is at step 4 of --steps 4; "
        f"the run's outputs are in {out}"]
    assert (out / "loss.png").is_file() and _rows(out) == four

    below = _train(out, "--steps", "3", "--resume")
    assert below.returncode == 2
    assert "--steps 3 is below the step of the checkpoint resumed from (4" in below.stderr

    more = _train(out, "--steps", "6", "--resume")
    assert more.returncode == 0, more.stderr[-3000:]
    six = _rows(out)
    assert [s for s, _ in six] == [1, 2, 3, 4, 5, 6] and six[:4] == four


def test_a_damaged_newest_checkpoint_is_one_message_and_exit_1(tmp_path):
    import json

    out = tmp_path / "run"
    assert _train(out, "--steps", "2").returncode == 0
    manifest = out / "checkpoints" / "global_step2" / "manifest.json"
    body = json.loads(manifest.read_text())
    body["global_steps"] = 3  # still valid JSON
    manifest.write_text(json.dumps(body, indent=1))
    resumed = _train(out, "--steps", "4", "--resume")
    assert resumed.returncode == 1
    assert "zerodist train: the newest checkpoint in" in resumed.stderr and "damaged, CRC-32" in resumed.stderr
    assert "No intact checkpoint is left to resume from." in resumed.stderr and "Traceback" not in resumed.stderr


def test_failed_interval_saves_let_the_run_finish_then_exit_1(tmp_path):
    import json

    (tmp_path / "not_a_directory").touch()  # every save fails: its tag directory cannot be made
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"checkpoint": {"save_dir": str(tmp_path / "not_a_directory")}}))
    done = _train(tmp_path / "run", "--steps", "4", "--config", str(config))  # saves at steps 2 and 4 fail
    assert done.returncode == 1
    out = done.stdout + done.stderr  # the warnings pass through the progress bar's writer
    assert out.count("Training goes on") == 2, out[-3000:]
    assert [s for s, _ in _rows(tmp_path / "run")] == [1, 2, 3, 4]  # every step trained, outputs written
    assert "zerodist train: the run ended with its last interval save failed" in done.stdout


@pytest.mark.parametrize("layout", [("--nproc", "1"), ("--nproc", "2", "--pp", "2")], ids=["plain", "pipe2"])
def test_a_kill_right_after_the_final_save_keeps_every_row_and_the_restart_writes_the_summary(tmp_path, layout):
    """Killed (SIGKILL) at the end of the final save, inside the last step: metrics.csv has every
    step's row (it was written before the step's save) and config.json (written before the first
    step); the restart, finding nothing left to train, writes summary.txt from metrics.csv."""
    from zerodist.checkpoint import KILL_ENV

    out = tmp_path / "run"
    nproc = int(layout[1])
    argv = ["train", "--model", "tiny", *layout, "--save-interval", "3", "--steps", "3", "--out", str(out)]
    # fresh ranks forked as a launch's are (the kill ends them): a rank runs `zerodist train` in place
    killed = launch(_zerodist, nproc, argv, env={KILL_ENV: "save-done"}, timeout=150)
    assert -9 in killed.exitcodes and (out / "checkpoints" / "global_step3").is_dir(), killed
    assert [s for s, _ in _rows(out)] == [1, 2, 3]
    assert (out / "config.json").is_file() and not (out / "summary.txt").exists()
    again = run_cli(nproc, *argv, "--resume", timeout=150)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines()[1:] == [f"wrote {out / 'summary.txt'}"]
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("summary: 3 steps, rebuilt from metrics.csv") and f"-> {float(_rows(out)[-1][1]):.3f}" in summary
