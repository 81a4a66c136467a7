"""`glassformer eval`: the perplexity of a model on a text."""

from __future__ import annotations

import argparse
import json

from .options import add, add_computing, or_default, settle_threads


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="perplexity of a model on a text")
    add(parser, "--model", "--data", required=True)
    add(parser, "--documents", "--batch-size", "--max-tokens", "--json")
    add_computing(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..language_model import load  # imported here: loading pulls in every loader
    from ..training.perplexity import corpus_ids, perplexity

    language_model = load(args.model)
    settle_threads(args)
    model, tokenizer = language_model.model.to(or_default(args.device, "cpu")), language_model.tokenizer
    ids = corpus_ids(args.data, tokenizer, or_default(args.documents, "file"))
    result = perplexity(model, ids, or_default(args.batch_size, 8), args.max_tokens)
    result.update(model=str(args.model), data=[str(d) for d in args.data])
    if args.json:
        print(json.dumps(result))
    else:
        print(f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f} "
              f"over {result['tokens']} tokens")
    return 0
