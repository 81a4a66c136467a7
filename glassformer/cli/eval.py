"""`glassformer eval`: the perplexity of a model on a text."""

from __future__ import annotations

import argparse
import json

from .options import add_threads, device, positive_int


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="perplexity of a model on a text")
    parser.add_argument("--model", required=True,
                        help="a run or checkpoint folder, .gguf file, HF folder or known name")
    parser.add_argument("--data", required=True, nargs="+", help="text file(s) or folder(s)")
    parser.add_argument("--documents", choices=("file", "line", "blank"), default="file")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--max-tokens", type=positive_int, default=None, help="score at most this many")
    parser.add_argument("--device", type=device, default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_threads(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..language_model import load  # imported here: loading pulls in every loader
    from ..training.perplexity import corpus_ids, perplexity

    language_model = load(args.model)
    model, tokenizer = language_model.model.to(args.device), language_model.tokenizer
    ids = corpus_ids(args.data, tokenizer, args.documents)
    result = perplexity(model, ids, args.batch_size, args.max_tokens)
    result.update(model=str(args.model), data=[str(d) for d in args.data])
    if args.json:
        print(json.dumps(result))
    else:
        print(f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f} "
              f"over {result['tokens']} tokens")
    return 0
