"""Memory of a partitioned Hugging Face build and pretrained load: a ~220M-parameter Llama on 2 ranks.

    python benchmarks/hf_load_pretrained.py [--dir DIR]        # launches 2 ranks itself

First (one process, once per DIR) an eager Llama (hidden 1024, 16 layers, vocab 8000: ~221M
parameters, 0.88 GB in fp32) is saved with `save_pretrained` as ~200 MB safetensors shards with
an index. Then on 2 ranks: build under `zerodist.zero.Init()`, `initialize()` at stage 3 (every
parameter sharded), and `zerodist.checkpoint.load_pretrained`. Each rank prints, as fractions of
the fp32 model:

- `load read`: bytes of tensor data the load read on that rank (its half, plus partial rows);
- `load largest`: the largest single read, which is the most the load allocates at once (each
  run is copied into the shard and dropped before the next is read);
- `load anon`: growth of the rank's private resident memory (RssAnon) across the load; the
  memory-mapped file pages are shared page cache, not counted;
- `build anon`: the same across `Init` + `initialize` (this rank's shard plus about a unit).

A benchmark, not a test: it prints figures and never fails on them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZE = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16,
        "num_key_value_heads": 16, "vocab_size": 8000, "max_position_embeddings": 256}


def _config():
    import transformers

    return transformers.LlamaConfig(**SIZE, bos_token_id=0, eos_token_id=0)


def _rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def prepare(directory: Path) -> None:
    import torch
    import transformers

    if (directory / "model.safetensors.index.json").is_file():
        return
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_config()).save_pretrained(directory, max_shard_size="200MB")


def run_rank(directory: Path) -> None:
    import torch
    import transformers

    import zerodist

    torch.set_num_threads(1)
    before = _rss_anon()
    started = time.perf_counter()
    with zerodist.zero.Init():
        model = transformers.LlamaForCausalLM(_config())
    full = sum(p.numel() for p in model.parameters()) * 4
    engine, *_ = zerodist.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    built, build_s = _rss_anon(), time.perf_counter() - started
    started = time.perf_counter()
    report = zerodist.checkpoint.load_pretrained(engine, directory)
    load_s = time.perf_counter() - started
    rank = zerodist.comm.get_rank()
    print(f"\nrank {rank}: {full / 4 / 1e6:.0f}M parameters, build {build_s:.1f} s, load {load_s:.1f} s; as fractions "
          f"of the fp32 model: build anon {(built - before) / full:.3f}, load read {report.bytes_read / full:.3f}, "
          f"load largest {report.largest_read / full:.3f}, load anon {(_rss_anon() - built) / full:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "zerodist-hf-llama-220m"))
    parser.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    directory = Path(args.dir)
    if args.rank_run:
        run_rank(directory)
        return
    prepare(directory)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "zerodist", "run", "--nproc", "2", __file__, "--dir", str(directory),
                    "--rank-run"], env=env, check=True)


if __name__ == "__main__":
    main()
