"""`zerodist config show FILE`: the config as zerodist resolves it, every default filled in."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("config", help="validate a DeepSpeed-style JSON config and show it resolved")
    sub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="print the resolved config (defaults filled, batch sizes solved)")
    show.add_argument("file", help="JSON config file")
    show.add_argument("--world-size", type=int, default=1, help="data-parallel world size for the batch arithmetic")
    show.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from zerodist.config import ConfigError, show_config

    try:
        print(show_config(args.file, world_size=args.world_size, world_size_source="--world-size"))
    except ConfigError as err:
        print(f"zerodist config: {err}", file=sys.stderr)
        return 2
    return 0
