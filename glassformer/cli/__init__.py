"""The `glassformer` command: parses arguments and calls library functions, nothing more."""

from __future__ import annotations

import argparse
import sys

from . import chat, compare, export, generate, info, journey, pull, serve, train
from . import eval as evaluate

# Each command module defines add_parser(subparsers) and run(args) -> exit status.
COMMANDS = [info, train, evaluate, journey, pull, export, compare, generate, chat, serve]


class UserError(Exception):
    """A mistake in the user's input: reported as one line, never a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glassformer", description="A glass-box decoder-only transformer."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (UserError, ValueError, FileNotFoundError, NotADirectoryError, OSError) as error:
        print(f"glassformer: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("glassformer: interrupted", file=sys.stderr)
        return 130
