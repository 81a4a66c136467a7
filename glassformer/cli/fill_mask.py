"""`glassformer fill-mask`: the most likely tokens at each mask token, with an encoder (BERT)."""

from __future__ import annotations

import argparse
import json

from .options import add_prompt, device, positive_int, read_prompt


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("fill-mask", help="predict the masked tokens of a text (BERT)")
    add_prompt(parser, "text with one or more mask tokens, e.g. 'To be or [MASK] to be'")
    parser.add_argument("--model", required=True, help="a checkpoint folder or Hugging Face folder")
    parser.add_argument("--top-k", type=positive_int, default=5, help="candidates per mask")
    parser.add_argument("--device", type=device, default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..language_model import load

    text = read_prompt(args)
    language_model = load(args.model, progress=not args.json).to(args.device)
    fills = language_model.fill_mask(text, args.top_k)
    if args.json:
        print(json.dumps({"text": text, "masks": [f.to_dict() for f in fills]}))
        return 0
    for number, fill in enumerate(fills, 1):
        print(f"mask {number} (token {fill.position}):")
        for c in fill.candidates:
            print(f"  {c.score:8.4f}  {c.token!r} (id {c.token_id})")
    return 0
