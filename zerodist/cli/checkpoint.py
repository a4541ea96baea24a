"""`zerodist checkpoint`: look inside checkpoints and turn them into one plain file.

    zerodist checkpoint inspect DIR            tags, step, ranks, stage, sizes, and a checksum
                                               check of every file (exit 1 if one is damaged)
    zerodist checkpoint consolidate DIR OUT    the plain model's fp32 state_dict() in one file
        [--tag T] [--format safetensors|torch] (default: by OUT's suffix; .pt/.pth/.bin: torch)
    zerodist checkpoint import-deepspeed DIR OUT   a DeepSpeed checkpoint (ZeRO 0-3) as a zerodist
        [--tag T] [--trust-pickle]             one under OUT, optimizer state and steps included,
                                               loadable at any world size and stage

DIR is a save directory (the newest committed tag is used unless --tag) or one tag's directory.
No process group is needed: these run on a laptop against a copy of the checkpoint.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("checkpoint", help="inspect or consolidate zerodist checkpoints",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = actions.add_parser("inspect", help="list tags with step, ranks, stage, size and integrity")
    inspect.add_argument("dir", help="a save directory or one tag's directory")
    inspect.add_argument("--no-verify", action="store_true", help="skip re-reading files to check their checksums")
    consolidate = actions.add_parser("consolidate", help="write the plain model's fp32 state_dict to one file")
    consolidate.add_argument("dir", help="a save directory or one tag's directory")
    consolidate.add_argument("out", help="output file (.safetensors, or .pt for torch.save)")
    consolidate.add_argument("--tag", default=None, help="tag to consolidate (default: the newest committed)")
    consolidate.add_argument("--format", choices=("safetensors", "torch"), default=None,
                             help="file format (default: from OUT's suffix, safetensors otherwise)")
    imported = actions.add_parser("import-deepspeed", help="convert a DeepSpeed checkpoint (ZeRO 0-3) to zerodist's "
                                  "format, optimizer state included")
    imported.add_argument("dir", help="DeepSpeed's save directory (its 'latest' tag is used) or one tag's directory")
    imported.add_argument("out", help="zerodist save directory to write the checkpoint into (same tag name)")
    imported.add_argument("--tag", default=None, help="DeepSpeed tag to convert (default: the one 'latest' names)")
    imported.add_argument("--trust-pickle", action="store_true",
                          help="unpickle the model-states files fully (runs what they ask): only for a trusted "
                          "checkpoint whose client_state holds classes other than DeepSpeed's")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from zerodist.checkpoint import CheckpointError

    try:
        actions = {"inspect": inspect, "consolidate": consolidate, "import-deepspeed": import_deepspeed}
        return actions[args.action](args)
    except (CheckpointError, ValueError, OSError) as err:
        print(f"zerodist checkpoint {args.action}: {err}", file=sys.stderr)
        return 1


def _size(num_bytes: int | None) -> str:
    from zerodist.utils import format_bytes

    return "-" if num_bytes is None else format_bytes(num_bytes)


def _cell(value: object, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def inspect(args: argparse.Namespace) -> int:
    from zerodist.checkpoint import inspect_checkpoints

    reports, latest = inspect_checkpoints(args.dir, verify=not args.no_verify)
    if not reports:
        print(f"{args.dir}: no checkpoints")
        return 1
    committed = sum(r.committed for r in reports)
    print(f"{args.dir}: {committed} committed checkpoint(s)" + (f", latest -> {latest}" if latest else ""))
    header = ("tag", "step", "ranks", "stage", "precision", "parameters", "files", "size", "integrity")
    rows = [header]
    for r in reports:
        integrity = ("not checked" if args.no_verify else "ok") if not r.problems else f"DAMAGED ({len(r.problems)} file(s))"
        if not r.committed:
            integrity = "DAMAGED (manifest)" if r.problems else "incomplete, skipped by load"
        rows.append((r.tag, _cell(r.global_steps), _cell(r.world_size), _cell(r.stage), _cell(r.precision),
                     _cell(r.num_params, "{:,}"), _cell(r.num_files), _size(r.total_bytes), integrity))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(w) if i in (0, 4, 8) else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
    for r in reports:
        for problem in r.problems:
            print(f"  {r.tag}: {problem}")
        if r.note:
            print(f"  {r.tag}: {r.note}")
    return 1 if any(r.problems for r in reports) else 0


def consolidate(args: argparse.Namespace) -> int:
    from zerodist.checkpoint import save_consolidated

    out, manifest, state = save_consolidated(args.dir, args.out, tag=args.tag, fmt=args.format)
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {out}: {len(state)} tensors, {numel:,} values, {_size(out.stat().st_size)}, from checkpoint "
          f"{manifest.tag} (step {manifest.global_steps}, {manifest.world_size} rank(s), ZeRO stage {manifest.stage}, "
          f"{manifest.precision})")
    return 0


def import_deepspeed(args: argparse.Namespace) -> int:
    from zerodist.checkpoint.deepspeed_import import import_deepspeed as convert

    tag_dir, state = convert(args.dir, args.out, tag=args.tag, trust_pickle=args.trust_pickle)
    numel = sum(t.numel() for t in state.params.values())
    kinds = sorted({k for values in state.optimizer.values() for k in values})
    print(f"wrote {tag_dir}: {len(state.params)} trained parameters ({numel:,} values) with {state.optimizer_class} "
          f"state {', '.join(kinds) or '(none)'}, {len(state.extra)} buffers/frozen tensors, step {state.global_steps}, "
          f"{state.precision}, from {state.source}")
    print(f"resume with engine.load_checkpoint({str(args.out)!r}) at any world size and ZeRO stage")
    return 0
