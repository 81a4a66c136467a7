"""`glassformer steer build`: a steering vector from two files of contrastive prompts."""

from __future__ import annotations

import argparse
import json

import torch

from ..errors import InputError
from ..formats.files import check_output, read_text
from ..interpret.steer import build_vector
from ..language_model import load
from .options import add, add_computing, settle_threads


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "steer", help="build a steering vector from contrastive prompts",
        description="glassformer steer build --model M --site blocks.12.resid_post --positive P.txt "
                    "--negative N.txt --out vec.safetensors: the mean of the site's activations "
                    "over every token of each positive prompt (one per line) minus the same over "
                    "the negative ones. Use it with generate --steer vec.safetensors:ALPHA, or "
                    "serve --steer NAME=vec.safetensors.",
    )
    parser.add_argument("action", choices=("build",), help="what to do")
    add(parser, "--model", required=True)
    parser.add_argument("--site", required=True,
                        help="a (batch, pos, d_model) hook site, e.g. blocks.12.resid_post")
    parser.add_argument("--positive", required=True, help="a UTF-8 file, one prompt per line")
    parser.add_argument("--negative", required=True, help="a UTF-8 file, one prompt per line")
    add(parser, "--out", required=True)  # the vector's safetensors file
    add(parser, "--force", "--json")
    add_computing(parser)
    parser.set_defaults(run=run)


def _prompts(loaded, path: str) -> list[list[int]]:
    lines = [line for line in read_text(path).splitlines() if line.strip()]
    if not lines:
        raise InputError(path, "no prompts (one per line)")
    return [loaded.encode(line) for line in lines]


def run(args: argparse.Namespace) -> int:
    check_output(args.out, [args.model, args.positive, args.negative], args.force)
    loaded = load(args.model).to(args.device or "cpu")
    settle_threads(args)
    model = loaded.model.eval()
    positive, negative = _prompts(loaded, args.positive), _prompts(loaded, args.negative)
    vector = build_vector(model, args.site, positive, negative, args.model)
    vector.save(args.out)
    summary = {"out": args.out, "site": vector.site, "model": vector.model, "width": vector.vector.shape[0],
               "norm": float(torch.linalg.vector_norm(vector.vector)), "positive": len(positive),
               "negative": len(negative)}
    print(json.dumps(summary) if args.json else
          f"wrote {args.out}: {vector.site}, width {summary['width']}, norm {summary['norm']:.3f} "
          f"({len(positive)} positive, {len(negative)} negative prompts)")
    return 0
