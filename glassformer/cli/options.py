"""Options shared by several commands."""

from __future__ import annotations

import argparse

from ..accel.quantize import QUANTIZE_CHOICES
from ..generation.sampling import SamplingConfig


def add_quantize(parser: argparse.ArgumentParser, default: str | None = "none") -> None:
    parser.add_argument(
        "--quantize", choices=QUANTIZE_CHOICES, default=default,
        help="inference weights: none = float32 through the fast kernels, bf16 / int8 / int4 "
             "converted once, gguf = a GGUF file's own Q8_0/Q4_x blocks"
             + ("" if default else " (default: the plain reference layers)"),
    )


def add_sampling(parser: argparse.ArgumentParser) -> None:
    """One flag per field of SamplingConfig."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)


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
