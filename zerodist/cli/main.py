"""`zerodist` entry point: dispatches to one module per subcommand.

Subcommand modules are imported only when their command runs (except for building the
parser, which imports each module's small `register` function), so `zerodist --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from typing import NoReturn

# (command, module): each module defines register(subparsers) and run(args) -> int.
COMMANDS = [
    ("train", "zerodist.cli.train"),
    ("run", "zerodist.cli.run"),
    ("doctor", "zerodist.cli.doctor"),
    ("config", "zerodist.cli.config"),
    ("estimate", "zerodist.cli.estimate"),
    ("pipe", "zerodist.cli.pipe"),
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


def run_and_exit() -> NoReturn:
    """The `zerodist` program (console script and `python -m zerodist`): `main()`, then an exit
    with its status that no rank turns into a crash (see [Note: leaving together])."""
    code = main()
    if is_rank_of_a_world():
        leave_together(code)
    raise SystemExit(code)


# [Note: leaving together]
# When every rank of a `zerodist` command reports the same error (a config error found after the
# group formed), the ranks end within a few milliseconds of each other, yet torchrun's agent
# SIGTERMs every rank still running as soon as it sees the first failure: the slower rank was
# reported as "exitcode -15 (SIGTERM)", and an interpreter torn down with a gloo group alive can
# abort instead ("terminate called without an active exception", exit -6). So a rank of a world
# (1) ignores SIGTERM from then on, (2) waits, through the store and for at most LEAVE_WAIT_S,
# until every rank is leaving, and (3) exits at once with os._exit, skipping the interpreter's
# finalization, where the gloo and tensor destructors would run after Python's own state is gone
# (no destructor runs at all). Files are closed and the streams flushed before it.
LEAVE_WAIT_S = 30.0


def is_rank_of_a_world() -> bool:
    # Not imported means no world, and `zerodist config show` need not import torch to learn it.
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def leave_together(code: int) -> NoReturn:
    from zerodist.comm import exchange_with_deadline

    # From here this rank only leaves: the agent's SIGTERM, sent as soon as a faster rank has
    # gone, must not replace the status it leaves with (seen as -15 with the status 2 it had).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        exchange_with_deadline("zerodist-cli-exit", str(code), timeout_s=LEAVE_WAIT_S)
    except Exception:  # a rank did not come (hung, or gone) or the store's host left: wait no more
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
