"""`glassformer journey`: trace one forward pass and write it as a self-contained HTML page."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..errors import InputError
from ..formats.files import check_output
from ..formats.tokenizers import CharTokenizer
from ..interpret.journey import collect_journey, summary, write_html
from ..interpret.journey.collect import MAX_TOKENS
from ..language_model import load
from ..model.encoder_decoder import EncoderDecoder, build_model
from ..model.presets import get_preset
from ..model.transformer import Transformer
from .options import (
    add,
    add_computing,
    add_prompt,
    or_default,
    positive_int,
    read_prompt,
    settle_threads,
)

TOP_K = 10
PRINTABLE = "".join(chr(c) for c in range(32, 127))  # 95 characters + end-of-text = 96 ids


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "journey", help="trace every step of one forward pass into an HTML report",
        description="Run TEXT through a model with every intermediate tensor recorded and write "
                    "the walk-through (equations, shapes, values, attention heatmaps, logit lens, "
                    "attribution) as one HTML file that needs no network.",
    )
    add_prompt(parser, "the prompt to trace")
    source = parser.add_mutually_exclusive_group(required=True)
    add(source, "--model", "--preset")  # a preset reads text with a character tokenizer
    add(parser, "--quantize", "--output", "--force", "--json", "--top-k")
    parser.add_argument("--ig-steps", type=positive_int, default=4,
                        help="integrated-gradient points per tenth of the path (default 4)")
    add(parser, "--max-tokens", "--seed")  # the page holds T x T attention weights per head and layer
    add_computing(parser)
    parser.set_defaults(run=run)


def random_model(preset: str, seed: int,
                 device: str) -> tuple[Transformer | EncoderDecoder, CharTokenizer]:
    config = get_preset(preset)
    if config.vocab_size < len(PRINTABLE) + 1:
        raise InputError("preset", f"{preset} has {config.vocab_size} ids, the character tokenizer needs 96")
    torch.manual_seed(seed)
    return build_model(config).to(device), CharTokenizer(PRINTABLE)


def _progress(stage: str) -> None:
    print(f"journey: {stage} ...", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    text = read_prompt(args)
    output = args.output or (None if args.json else "journey.html")
    if output is not None:  # refused before the model is read, never after the work is done
        inputs = [p for p in (args.model, args.prompt_file) if p is not None]
        check_output(output, inputs, args.force)
    device = or_default(args.device, "cpu")
    if args.model is not None:
        loaded = load(args.model, quantize=args.quantize).to(device)
        settle_threads(args)
        model, tokenizer = loaded.model, loaded.tokenizer
    else:
        model, tokenizer = random_model(args.preset, or_default(args.seed, 0), device)
    data = collect_journey(model.eval(), tokenizer, text, top_k=or_default(args.top_k, TOP_K),
                           ig_steps=args.ig_steps, max_tokens=or_default(args.max_tokens, MAX_TOKENS),
                           progress=_progress)
    if output is not None:
        _progress(f"writing {output}")
        write_html(data, output)
    if args.json:
        print(json.dumps(summary(data), ensure_ascii=False))
    else:
        print(f"wrote {output}: {len(data['tokens'])} tokens through {model.config.n_layers} layers")
    return 0
