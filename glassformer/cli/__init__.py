"""The `glassformer` command: parses arguments and calls library functions, nothing more."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..accel import threads
from ..errors import InputError
from ..formats.files import write_atomic
from ..home import home
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
from .options import error_line

# Each command module defines add_parser(subparsers) and run(args) -> exit status.
COMMANDS = [info, train, evaluate, journey, pull, export, compare, generate, fill_mask, chat, serve,
            experiment, lens, steer]


# the file errors a command expects from the paths it is given, and a download that cannot
# reach its server: reported as one line
FILE_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
               ConnectionError)


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
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:
        return int(done.code or 0)
    with warnings.catch_warnings():
        warnings.showwarning = _warn
        try:
            if hasattr(args, "threads"):  # a command that computes: settled once it has loaded
                args.thread_policy = threads.ThreadPolicy(args.threads)
            return args.run(args)
        except KeyboardInterrupt:
            print("glassformer: interrupted", file=sys.stderr)
            return 130
        except Exception as error:
            if users_mistake(error):
                print(f"glassformer: error: {error_line(error, flag_names(parser, args.command))}",
                      file=sys.stderr)
                return 2
            report = crash_report(error, args.command)
            if report is None:
                raise  # no file to hold it: the traceback itself
            message = " ".join(str(error).split())
            print(f"glassformer: internal error: {type(error).__name__}: {message}; the full report is "
                  f"in {report}", file=sys.stderr)
            return 1


def flag_names(parser: argparse.ArgumentParser, command: str) -> set[str]:
    """The settings `command` takes as --flags (not its positional arguments), by their names."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest for a in commands.choices[command]._actions if a.option_strings}


def users_mistake(error: Exception) -> bool:
    """An InputError, a file error about a path (a missing file, a full disk writing one) or a
    failed download: one line and exit 2. Anything else is a bug in Glassformer."""
    if isinstance(error, (InputError, *FILE_ERRORS)):
        return True
    return isinstance(error, OSError) and error.filename is not None


def crash_report(error: Exception, command: str) -> Path | None:
    """The traceback written to <home>/crash-reports/<time>-<pid>.txt (atomically); None where it
    cannot be written."""
    now = datetime.now(timezone.utc)
    text = (f"glassformer {_version()}, command {command!r}, {now.isoformat()}\n\n"
            + "".join(traceback.format_exception(error)))
    try:
        folder = home() / "crash-reports"
        folder.mkdir(parents=True, exist_ok=True)
        return write_atomic(folder / f"{now:%Y%m%dT%H%M%S%fZ}-{os.getpid()}.txt", text)
    except OSError:
        return None
