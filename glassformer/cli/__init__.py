"""The `glassformer` command: parses arguments and calls library functions, nothing more."""

from __future__ import annotations

import argparse
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version

from ..accel import threads
from . import (
    chat,
    compare,
    experiment,
    export,
    fill_mask,
    generate,
    info,
    journey,
    lens,
    pull,
    serve,
    steer,
    train,
)
from . import eval as evaluate

# Each command module defines add_parser(subparsers) and run(args) -> exit status.
COMMANDS = [info, train, evaluate, journey, pull, export, compare, generate, fill_mask, chat, serve,
            experiment, lens, steer]


class UserError(Exception):
    """A mistake in the user's input: reported as one line, never a traceback."""


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line (no usage block) with exit status 2."""

    def error(self, message: str):
        print(f"glassformer: error: {message}", file=sys.stderr)
        sys.exit(2)


def _version() -> str:
    try:
        return version("glassformer")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="glassformer", description="Glass-box transformers to train, generate with, "
                    "serve and look inside: decoders (GPT, Llama), encoders (BERT) and "
                    "encoder-decoders (T5).")
    parser.add_argument("--version", action="version", version=f"glassformer {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def _warn(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"glassformer: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:
        return int(done.code or 0)
    with warnings.catch_warnings():
        warnings.showwarning = _warn
        try:
            if hasattr(args, "threads"):  # a command that computes: settled once it has loaded
                args.thread_policy = threads.ThreadPolicy(args.threads)
            return args.run(args)
        except (UserError, ValueError, FileNotFoundError, NotADirectoryError, OSError) as error:
            print(f"glassformer: error: {error}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("glassformer: interrupted", file=sys.stderr)
            return 130
