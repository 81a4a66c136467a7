"""Options shared by several commands, and argument types that refuse bad values at parse time."""

from __future__ import annotations

import argparse
import math
import sys

from ..accel.quantize import QUANTIZE_CHOICES
from ..formats.files import read_text
from ..generation.sampling import SamplingConfig


def add_quantize(parser: argparse.ArgumentParser, default: str | None = "none") -> None:
    parser.add_argument(
        "--quantize", choices=QUANTIZE_CHOICES, default=default,
        help="inference weights: none = float32 through the fast kernels, bf16 / int8 / int4 "
             "converted once, gguf = a GGUF file's own Q8_0/Q4_x blocks"
             + ("" if default else " (default: the plain reference layers)"),
    )


def add_threads(parser: argparse.ArgumentParser, reserved: int = 0) -> None:
    """--threads; `reserved`: cores the command keeps for other work of its own."""
    parser.set_defaults(threads_reserved=reserved, thread_policy=None)  # the policy: main() makes it
    parser.add_argument(
        "--threads", type=positive_int, default=None,
        help="compute threads (default: GLASSFORMER_THREADS or OMP_NUM_THREADS if set, else "
             "one per core other processes leave free, looked at again during long runs)",
    )


def add_sampling(parser: argparse.ArgumentParser) -> None:
    """One flag per field of SamplingConfig."""
    parser.add_argument("--temperature", type=non_negative, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-k", type=positive_int, default=None)
    parser.add_argument("--top-p", type=finite, default=1.0)
    parser.add_argument("--min-p", type=finite, default=0.0)
    parser.add_argument("--repetition-penalty", type=finite, default=1.0)
    parser.add_argument("--presence-penalty", type=finite, default=0.0)
    parser.add_argument("--frequency-penalty", type=finite, default=0.0)


def sampling_config(args: argparse.Namespace) -> SamplingConfig:
    """The SamplingConfig that the flags of `add_sampling` describe."""
    return SamplingConfig(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )


def finite(text: str) -> float:
    """A float that is a number: nan and inf are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def non_negative(text: str) -> float:
    value = finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive(text: str) -> float:
    value = finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def device(text: str) -> str:
    """A device this machine has: cpu, cuda[:N] with CUDA present, mps where available."""
    from ..training.distributed import pick_device

    try:
        pick_device(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("device: ")) from None
    return text


def add_prompt(parser: argparse.ArgumentParser, what: str) -> None:
    """PROMPT as an argument, `-` for standard input, or --prompt-file F (an argument is
    capped by the OS near 128 KiB)."""
    parser.add_argument("prompt", nargs="?", help=f"{what} ('-' reads standard input)")
    parser.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from the argument, standard input or --prompt-file, checked to be UTF-8."""
    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give a prompt or --prompt-file, not both" if args.prompt is not None
                         else "no prompt: give one, '-' for standard input, or --prompt-file")
    if args.prompt_file is not None:
        return read_text(args.prompt_file)
    if args.prompt == "-":
        return _utf8(sys.stdin.buffer.read(), "standard input")
    return checked_text(args.prompt, "the prompt")


def checked_text(text: str, where: str) -> str:
    """Text from argv or a terminal holds lone surrogates where its bytes were not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{where} is not valid UTF-8 (character {error.start})") from None
    return text


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{where}: not valid UTF-8 (byte {error.start})") from None
