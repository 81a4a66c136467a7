"""`glassformer fill-mask`: the most likely tokens at each mask token, with an encoder (BERT)."""

from __future__ import annotations

import argparse
import json

from .options import add, add_computing, add_prompt, or_default, read_prompt, settle_threads

TOP_K = 5


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("fill-mask", help="predict the masked tokens of a text (BERT)")
    add_prompt(parser, "text with one or more mask tokens, e.g. 'To be or [MASK] to be'")
    add(parser, "--model", required=True)
    add(parser, "--top-k", "--json")
    add_computing(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..language_model import load

    text = read_prompt(args)
    language_model = load(args.model, progress=not args.json).to(or_default(args.device, "cpu"))
    settle_threads(args)
    fills = language_model.fill_mask(text, or_default(args.top_k, TOP_K))
    if args.json:
        print(json.dumps({"text": text, "masks": [f.to_dict() for f in fills]}))
        return 0
    for number, fill in enumerate(fills, 1):
        print(f"mask {number} (token {fill.position}):")
        for c in fill.candidates:
            print(f"  {c.score:8.4f}  {c.token!r} (id {c.token_id})")
    return 0
