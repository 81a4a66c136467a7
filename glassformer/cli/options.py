"""Options shared by several commands."""

from __future__ import annotations

import argparse

QUANTIZE_CHOICES = ("none", "bf16", "int8", "int4", "gguf")


def add_quantize(parser: argparse.ArgumentParser, default: str | None = "none") -> None:
    parser.add_argument(
        "--quantize", choices=QUANTIZE_CHOICES, default=default,
        help="inference weights: none = float32 through the fast kernels, bf16 / int8 / int4 "
             "converted once, gguf = a GGUF file's own Q8_0/Q4_x blocks"
             + ("" if default else " (default: the plain reference layers)"),
    )
