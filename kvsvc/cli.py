"""The ``kvsvc`` command line: plan, serve, worker, demo, ctl, vllm-args, indexer, router,
replay."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvsvc import __version__

# Subcommand name -> module in kvsvc.commands (see that package's docstring).
SUBCOMMANDS: tuple[str, ...] = (
    "plan",
    "serve",
    "worker",
    "demo",
    "ctl",
    "vllm-args",
    "indexer",
    "router",
    "replay",
)
# Subcommands whose parser lives in their own package: name -> (module, function).
ELSEWHERE: dict[str, tuple[str, str]] = {
    "indexer": ("kvsvc.cluster.commands", "add_indexer_parser"),
    "router": ("kvsvc.cluster.commands", "add_router_parser"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsvc",
        description="KV-cache manager service for LLM engines: block pools, prefix caching, "
        "memory plans, over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"kvsvc {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        if name in ELSEWHERE:
            module_name, function = ELSEWHERE[name]
            getattr(importlib.import_module(module_name), function)(subparsers)
            continue
        try:
            module = importlib.import_module(f"kvsvc.commands.{name.replace('-', '_')}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvsvc.commands.{name.replace('-', '_')}":
                raise
            continue  # not built yet
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    command = ""
    try:
        # Building the parser imports every subcommand (grpc among them: a few hundred
        # ms), so Ctrl-C lands here as often as in the command itself.
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        command = args.command
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        # Ctrl-C where the command does not handle it itself (imports, a worker importing
        # torch, a plan being computed): one line, not a traceback. 130: killed by SIGINT.
        print(f"kvsvc{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
