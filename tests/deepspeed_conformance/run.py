"""Run DeepSpeed's own unit tests against zerodist: ``import deepspeed`` served by zerodist.

    python tests/deepspeed_conformance/run.py                       # clones DeepSpeed (network)
    python tests/deepspeed_conformance/run.py --deepspeed-repo PATH # a checkout or a bare git dir
    python tests/deepspeed_conformance/run.py --group zero          # DeepSpeed's ZeRO test files

DeepSpeed's test files are fetched at run time (never stored in this repository) into a work
directory laid out as DeepSpeed's ``tests/`` (``unit/...``), next to zerodist's own ``unit/common.py``
(``DistributedTest``: each method on its world size, forked ranks on gloo) and ``unit/util.py``;
DeepSpeed's helper modules the files import (``unit/alexnet_model.py``, ``unit/simple_model.py``)
are fetched too. pytest then runs there with ``zerodist run --as-deepspeed``'s environment, once per
unknown-key policy (``strict``: zerodist's default, which refuses DeepSpeed's own misspelt keys; ``warn``:
``ZERODIST_UNKNOWN_KEYS=warn``, which ignores them as DeepSpeed does), and the pass counts by file and
mode are printed, each test that does not pass with its reason (README.md records the last run's). Not
part of the default suite.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
URL = "https://github.com/deepspeedai/DeepSpeed"

PIPELINE_FILES = [
    "tests/unit/runtime/pipe/test_topology.py",
    "tests/unit/runtime/pipe/test_pipe_schedule.py",
    "tests/unit/pipe/test_pipe_module.py",
    "tests/unit/runtime/pipe/test_pipe.py",
]
_ZERO = "tests/unit/runtime/zero/test_"
_ZERO_V1 = "tests/unit/v1/zero/test_"
_MOE = "tests/unit/v1/moe/test_"
# DeepSpeed's test files by group (`--group`); the default runs "pipe" and "ulysses".
GROUPS = {
    "pipe": PIPELINE_FILES,
    "ulysses": ["tests/unit/sequence_parallelism/test_ulysses.py"],
    "zero": [_ZERO + name + ".py" for name in (
        "zero_config", "zero_context", "zero_context_ancestry", "zero_context_return", "zero_dynamic_class",
        "zero_nesting_init", "zero_linear_direct_init", "zero_late_module_attach", "zero_leaf_module",
        "zero_hook_attribute_delegation", "zero_grad_clip", "zero_tiled", "zero_tensor_fragment", "zeropp",
        "zero_offloadpp", "zero_allreduce_fetch_params", "zero_autocast_mixed_dtype", "nvme_checkpointing",
        "ignore_unused_parameters", "unwrap_model")] + [_ZERO_V1 + name + ".py" for name in (
        "zero", "zero_user_backward", "zero_coalesce_grad_reduction", "zero_torch_func", "zero_autocast",
        "zero_init_pg_contradiction", "zero2_offload_multi_backward", "zero_cpu_offload_grad_accum",
        "zero_functorch_linear", "zero_hook_count_regression", "zero_activation_checkpoint_lifecycle",
        "offload_states", "overlap_comm_record_stream", "stage2_flatten_on_gpu")],
    "moe": [_MOE + "moe.py", _MOE + "moe_tp.py", "tests/unit/checkpoint/test_moe_checkpoint.py"] + [
        _MOE + name + ".py" for name in (  # AutoEP (and its fused-expert layout helper)
            "autoep_unit", "autoep_integration", "autoep_grad_parity", "autoep_checkpoint", "autoep_autotp_runtime",
            "autoep_autotp_checkpoint", "autoep_autotp_grad_parity", "autoep_autotp_dispatch",
            "autoep_autotp_folding_config", "autoep_autotp_folding_groups", "autoep_autotp_deepcompile_reject",
            "autoep_autotp_bf16_folding_parity", "autoep_autotp_zero1_overlap_folding", "fused_expert_layout")],
}
FILES = GROUPS["pipe"] + GROUPS["ulysses"]
ALL_FILES = [file for files in GROUPS.values() for file in files]
HELPERS = ["tests/unit/alexnet_model.py", "tests/unit/simple_model.py", "tests/unit/runtime/zero/utils.py",
           "tests/unit/checkpoint/common.py", "tests/unit/v1/moe/autoep_test_utils.py"]


def read_from(source: Path, path: str) -> str | None:
    """`path` from a checkout or a bare git directory, or None when it has none."""
    if (source / path).is_file():
        return (source / path).read_text()
    result = subprocess.run(["git", "--git-dir", str(source), "show", f"HEAD:{path}"], capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else None


def prepare(source: Path, work: Path, files: list[str]) -> list[Path]:
    unit = work / "unit"
    unit.mkdir(parents=True)
    for package in {Path(f).parent for f in files + HELPERS}:
        for level in [package, *package.parents]:
            if level.parts[:2] == ("tests", "unit"):
                (work / level.relative_to("tests") / "__init__.py").parent.mkdir(parents=True, exist_ok=True)
                (work / level.relative_to("tests") / "__init__.py").touch()
    for path in HELPERS:
        text = read_from(source, path)
        if text is not None:
            (work / Path(path).relative_to("tests")).write_text(text)
    shutil.copy(HERE / "common.py", unit / "common.py")
    shutil.copy(HERE / "util.py", unit / "util.py")
    shutil.copy(HERE / "conftest_template.py", work / "conftest.py")
    (work / "pytest.ini").write_text("[pytest]\nmarkers =\n    sequential\n    nightly\n    world_size\n")
    fetched = []
    for path in files:
        text = read_from(source, path)
        if text is None:
            print(f"{path}: not in the source", file=sys.stderr)
            continue
        target = work / Path(path).relative_to("tests")
        target.write_text(text)
        fetched.append(target)
    return fetched


Outcome = tuple[str, str, str]  # (test id, "passed" / "failed" / "skipped", reason: the message's last line)


def outcomes(report: Path, run_file: str = "") -> dict[str, list[Outcome]]:
    """Each test case of a junit report, by DeepSpeed file; a case named after no file (a collection
    error has an empty class name) is `run_file`'s, the file the report's session ran."""
    by_file: dict[str, list[Outcome]] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = case.get("classname", "").replace(".", "/")
        # the whole module name: test_zero must not claim test_zero2_offload_multi_backward's cases
        file = next((f for f in ALL_FILES if (name + "/").startswith(f.removeprefix("tests/").removesuffix(".py") + "/")),
                    run_file or name)
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                reason = _reason(child.text or child.get("message") or "")
        test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        by_file.setdefault(file, []).append((test, outcome, reason))
    return by_file


def _reason(text: str) -> str:
    """The line of a failure that says why: the last exception line (``NameError: ...``), else the last line."""
    lines = [line.strip().removeprefix("E").strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit|Failed|Skipped)\b", line)]
    return (errors or lines or [""])[-1][:300]


def run_mode(mode: str, fetched: list[Path], work: Path, pytest_args: list[str]) -> dict[str, list[Outcome]]:
    """pytest on each file in its own session (a file that does not import stops only itself), with the
    unknown-key policy `mode` ("strict": zerodist's default, "warn": ignored as DeepSpeed ignores them)."""
    from zerodist.config.unknown_keys import ENV_VAR
    from zerodist.integrations.as_deepspeed import environment

    env = environment({**os.environ, "PYTHONPATH": os.pathsep.join([str(work / "tests"), str(REPO)])})
    env.pop(ENV_VAR, None)
    # Tests that load a model from the hub fail at once, naming it, instead of waiting on the network.
    env.setdefault("HF_HUB_OFFLINE", "1")
    if mode == "warn":
        env[ENV_VAR] = "warn"
    results: dict[str, list[Outcome]] = {}
    for index, test_file in enumerate(fetched):
        report = work / f"report-{mode}-{index}.xml"
        # DeepSpeed's directories below unit/ have no __init__.py, so its pytest puts a file's own directory
        # on sys.path: `from utils import setup_serial_env` in runtime/zero/ finds runtime/zero/utils.py.
        file_env = {**env, "PYTHONPATH": os.pathsep.join([str(test_file.parent), env["PYTHONPATH"]])}
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
                                 f"--junitxml={report}", str(test_file), *pytest_args], cwd=work / "tests",
                                env=file_env, capture_output=True, text=True)
        sys.stdout.write(result.stdout[-4000:])
        if report.exists():
            results.update(outcomes(report, str(test_file.relative_to(work))))
    return results


def print_table(files: list[str], by_mode: dict[str, dict[str, list[Outcome]]]) -> None:
    for file in files:
        counts = []
        for mode, results in by_mode.items():
            c = Counter(outcome for _, outcome, _ in results.get(file, []))
            counts.append(f"{mode}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
        print(f"{file}: " + "; ".join(counts))
        for mode, results in by_mode.items():
            for test, outcome, reason in results.get(file, []):
                if outcome != "passed":
                    print(f"    [{mode}] {outcome} {test}: {reason}")
    pipeline = [file for file in files if file in PIPELINE_FILES]
    if pipeline:  # the acceptance counts these together (DeepSpeed itself passes 38 of their 44 on the CPU)
        totals = [f"{mode}: {sum(o == 'passed' for f in pipeline for _, o, _ in results.get(f, []))} of "
                  f"{sum(len(results.get(f, [])) for f in pipeline)} passed" for mode, results in by_mode.items()]
        print("pipeline, topology and schedule files together: " + "; ".join(totals))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-repo", type=Path, default=None, help="a DeepSpeed checkout or bare git dir")
    parser.add_argument("--files", nargs="*", default=None, help="DeepSpeed test files (default: the groups')")
    parser.add_argument("--group", nargs="*", default=None, choices=list(GROUPS),
                        help="groups of files to run (default: pipe and ulysses)")
    parser.add_argument("--modes", nargs="*", default=["strict", "warn"], choices=["strict", "warn"],
                        help="unknown-key policies to run under (default: both)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds each test's ranks may take (default: the class's exec_timeout, 120 s)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    if args.files is None:
        args.files = [file for group in args.group for file in GROUPS[group]] if args.group else FILES
    work = Path(tempfile.mkdtemp(prefix="zerodist-ds-conformance-"))
    source = args.deepspeed_repo
    if source is None:
        source = work / "DeepSpeed"
        subprocess.run(["git", "clone", "--depth", "1", URL, str(source)], check=True)
    fetched = prepare(source, work / "tests", args.files)
    sys.path.insert(0, str(REPO))
    if args.timeout is not None:
        os.environ["ZERODIST_CONFORMANCE_TIMEOUT"] = str(args.timeout)
    by_mode = {mode: run_mode(mode, fetched, work, args.pytest_args) for mode in args.modes}
    print_table(args.files, by_mode)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work directory: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
