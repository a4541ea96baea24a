"""`zerodist` entry point: dispatches to one module per subcommand.

Subcommand modules are imported only when their command runs (except for building the
parser, which imports each module's small `register` function), so `zerodist --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (command, module): each module defines register(subparsers) and run(args) -> int.
COMMANDS = [
    ("train", "zerodist.cli.train"),
    ("run", "zerodist.cli.run"),
    ("doctor", "zerodist.cli.doctor"),
    ("config", "zerodist.cli.config"),
    ("estimate", "zerodist.cli.estimate"),
    ("bench", "zerodist.cli.bench"),
    ("checkpoint", "zerodist.cli.checkpoint"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerodist",
        description="ZeRO-partitioned multi-process training for PyTorch.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _, module_name in COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name == module_name:
                continue  # a subcommand not built yet
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.handler(args) or 0)
