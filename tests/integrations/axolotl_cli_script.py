"""axolotl's own CLI, unchanged, on zerodist: `zerodist run --as-deepspeed --nproc 2 -- axolotl train cfg.yml
--launcher python` with axolotl's `zero2.json` / `zero3.json`, against the same CLI under DDP (`axolotl train
cfg.yml --launcher torchrun -- --nproc_per_node 2`). A tiny Llama built from a config, a word-level tokenizer
and a 64-row completion data set, all local (no hub); fp32; 6 steps of micro 2 x accumulation 2 x 2 ranks.

    python tests/integrations/axolotl_cli_script.py WORKDIR [--runs ddp z2 z3]

Needs axolotl installed in this interpreter's environment (docs/integrations.md, "axolotl", says how it
installs here); run by tests/integrations/test_axolotl_cli.py where it is. Prints each run's six losses
(`trainer_state.json` of the checkpoint at step 6, full precision) and exits non-zero when a zerodist run's
losses differ from DDP's by more than 1e-5 or rank 0's log does not say that zerodist trains.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "tests" / "config" / "templates"  # axolotl's deepspeed_configs/ as shipped (SOURCES.md)
VOCAB, ROWS, STEPS, TOLERANCE = 96, 64, 6, 1e-5
ANNOUNCE = "zerodist trains: `import deepspeed` is served by zerodist"

YAML = """base_model: {work}/model
tokenizer_type: PreTrainedTokenizerFast
datasets:
  - path: {work}/data.jsonl
    ds_type: json
    type: completion
dataset_prepared_path: {work}/prepared-{run}
output_dir: {work}/out-{run}
val_set_size: 0
sequence_len: 32
sample_packing: false
micro_batch_size: 2
gradient_accumulation_steps: 2
max_steps: {steps}
optimizer: adamw_torch
lr_scheduler: cosine
learning_rate: 0.001
max_grad_norm: 1.0
bf16: false
fp16: false
tf32: false
logging_steps: 1
save_strategy: steps
save_steps: {steps}
seed: 0
dataset_processes: 1
"""


def make_inputs(work: Path) -> None:
    """The tiny Llama and its tokenizer saved to `work/model`, and the data set, as files."""
    import tokenizers
    import torch
    import transformers

    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="t0", eos_token="t2",
                                                     bos_token="t3", unk_token="t1")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=3, eos_token_id=2, pad_token_id=0))
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    rows = torch.randint(4, VOCAB, (ROWS, 15), generator=torch.Generator().manual_seed(1)).tolist()
    (work / "data.jsonl").write_text("".join(json.dumps({"text": " ".join(f"t{i}" for i in row)}) + "\n"
                                             for row in rows))


def write_config(work: Path, run: str, on_cpu: bool) -> Path:
    text = YAML.format(work=work, run=run, steps=STEPS)
    if run != "ddp":
        template = work / f"zero{run[1]}.json"
        shutil.copy(TEMPLATES / f"axolotl_zero{run[1]}.json", template)
        text += f"deepspeed: {template}\n"
    if on_cpu:
        # axolotl gives every rank of a multi-rank run `device_map={"": LOCAL_RANK}` (a GPU index), which
        # transformers cannot place on a machine without one; a CPU-only max_memory makes its loader place
        # the model on the CPU instead (axolotl's own option, no code changed).
        text += "max_memory:\n  cpu: 8GiB\n"
    path = work / f"{run}.yml"
    path.write_text(text)
    return path


def command(run: str, config: Path) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "AXOLOTL_DO_NOT_TRACK": "1",
           # axolotl shows other libraries' records from WARNING up only; INFO lets zerodist's lines through
           "LOG_LEVEL": "INFO",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
           # axolotl starts `torchrun` / `accelerate` by name: this environment's, as an activated venv would
           "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))}
    axolotl = shutil.which("axolotl", path=str(Path(sys.executable).parent)) or "axolotl"
    if run == "ddp":
        if not _has_cuda():
            env.setdefault("ACCELERATE_USE_CPU", "1")  # else transformers leaves each rank to train alone
        return [axolotl, "train", str(config), "--launcher", "torchrun", "--", "--nproc_per_node", "2"], env
    return [sys.executable, "-m", "zerodist", "run", "--as-deepspeed", "--nproc", "2", "--",
            axolotl, "train", str(config), "--launcher", "python"], env


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def losses(work: Path, run: str) -> list[float]:
    state = json.loads((work / f"out-{run}" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("work")
    parser.add_argument("--runs", nargs="+", default=["ddp", "z2", "z3"], choices=["ddp", "z2", "z3"])
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    make_inputs(work)
    on_cpu = not _has_cuda()
    results, failures = {}, []
    for run in args.runs:
        argv, env = command(run, write_config(work, run, on_cpu))
        with open(work / f"{run}.log", "w") as log:
            code = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        output = (work / f"{run}.log").read_text()
        if code != 0:
            failures.append(f"{run}: exit status {code}; the end of {work / (run + '.log')}:\n{output[-3000:]}")
            continue
        results[run] = losses(work, run)
        sys.stdout.write(f"{run:4s} {results[run]}\n")
        if run != "ddp" and f"[zerodist INFO rank 0] {ANNOUNCE}" not in output:
            failures.append(f"{run}: rank 0 did not log {ANNOUNCE!r}")
    if "ddp" in results:
        for run in set(results) - {"ddp"}:
            gap = max(abs(a - b) for a, b in zip(results[run], results["ddp"], strict=True))
            sys.stdout.write(f"{run} vs ddp: largest loss difference {gap:.3g}\n")
            if gap > TOLERANCE:
                failures.append(f"{run}: losses differ from DDP's by {gap:.3g} > {TOLERANCE}")
    for failure in failures:
        sys.stderr.write(failure + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
