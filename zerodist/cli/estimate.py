"""`zerodist estimate`: per-rank memory of a model under each ZeRO stage, before you run it.

    zerodist estimate --params 7B --world-size 64 --dtype bf16
    zerodist estimate --params 125M --world-size 2 --stage 2 --hidden 768 --layers 12 --seq-len 1024 --micro-batch 8
    zerodist estimate --params 40M --frozen-params 7B --world-size 8 --dtype bf16     # LoRA on a 7B base

Pure arithmetic (no GPU, no processes): the formulas are in zerodist/debug/estimate.py and
docs/debugging.md.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("estimate", help="per-rank memory for each ZeRO stage (pure formulas)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", required=True, help="number of parameters, e.g. 7B, 125M, 1.5T, 350000")
    p.add_argument("--frozen-params", default="0",
                   help="parameters no optimizer steps (a LoRA base, a reference model): their bytes only")
    p.add_argument("--world-size", type=int, required=True, help="number of data-parallel ranks")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None, help="one stage (default: all)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="parameter/gradient dtype; bf16/fp16 mean mixed precision with fp32 master weights")
    p.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default="adam", help="(sgd: with momentum)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (for activations)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (for activations)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (for activations)")
    p.add_argument("--micro-batch", type=int, default=None, help="micro-batch size per rank (for activations)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default hidden/64)")
    p.add_argument("--activation-checkpointing", action="store_true", help="keep only each layer's input")
    p.add_argument("--flash-attention", action="store_true",
                   help="attention never materialises the seq x seq scores (flash, or scaled_dot_product_attention on CPU)")
    p.add_argument("--reduce-bucket-size", default="5e8", help="gradient bucket, elements (default 5e8)")
    p.add_argument("--allgather-bucket-size", default="5e8", help="parameter bucket, elements (default 5e8)")
    p.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"), default="none",
                   help="nvme: the optimizer state in swap files (shown as disk), streamed through host buffers")
    p.add_argument("--offload-param", choices=("none", "cpu", "nvme"), default="none",
                   help="stage 3, with --offload-optimizer nvme: the parameter shards in the swap files too")
    p.add_argument("--sub-group-size", default="1e9", help="nvme: elements per swapped sub-group (default 1e9)")
    p.add_argument("--buffer-count", type=int, default=4, help="nvme: host buffers of one sub-group (default 4)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from zerodist.debug.estimate import estimate_memory, format_table, parse_count

    try:
        num_params = parse_count(args.params)
        frozen = 0 if str(args.frozen_params).strip() in ("", "0") else parse_count(args.frozen_params)
        buckets = parse_count(args.reduce_bucket_size), parse_count(args.allgather_bucket_size)
        stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
        estimates = [
            estimate_memory(
                num_params, world_size=args.world_size, stage=stage, dtype=args.dtype, optimizer=args.optimizer,
                hidden=args.hidden, layers=args.layers, seq_len=args.seq_len, micro_batch=args.micro_batch,
                heads=args.heads, activation_checkpointing=args.activation_checkpointing,
                flash_attention=args.flash_attention,
                reduce_bucket_size=buckets[0], allgather_bucket_size=buckets[1],
                offload_optimizer=args.offload_optimizer, sub_group_size=parse_count(args.sub_group_size),
                buffer_count=args.buffer_count, offload_param=args.offload_param, frozen=frozen,
            )
            for stage in stages
        ]
    except ValueError as err:
        raise SystemExit(f"zerodist estimate: {err}") from None
    precision = "fp32 training" if args.dtype == "fp32" else f"{args.dtype} mixed precision (fp32 master weights)"
    offload = "" if args.offload_optimizer == "none" else f", offload_optimizer {args.offload_optimizer}"
    offload += "" if args.offload_param == "none" else f", offload_param {args.offload_param}"
    frozen_text = f" and {frozen:,} frozen (Φ)" if frozen else ""
    print(f"{num_params:,} parameters (Ψ){frozen_text} on {args.world_size:,} ranks (N), {precision}, "
          f"{args.optimizer}{offload}; "
          f"bytes per rank (memory: device and host are one on a CPU machine; disk: swap files):")
    print(format_table(estimates))
    if estimates[0].activations is None:
        print("activations: give --hidden --layers --seq-len --micro-batch to include them")
    return 0
