"""`glassformer compare`: our forward pass against a reference implementation, layer by layer."""

from __future__ import annotations

import argparse
import json

import torch

from .options import (
    add,
    add_computing,
    add_prompt,
    non_negative,
    or_default,
    read_prompt,
    settle_threads,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare", help="diff every layer against a reference implementation on the same weights")
    add_prompt(parser, "the text both implementations read")
    add(parser, "--model", required=True)
    parser.add_argument("--reference", choices=("hf",), default="hf",
                        help="hf: Hugging Face transformers (must be installed)")
    parser.add_argument("--atol", type=non_negative, default=1e-4, help="absolute tolerance")
    parser.add_argument("--rtol", type=non_negative, default=1e-4,
                        help="tolerance relative to the largest reference value at each place")
    add(parser, "--json")
    add_computing(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..interpret.compare import compare, hf_reference
    from ..language_model import load

    prompt = read_prompt(args)
    device = or_default(args.device, "cpu")
    language_model = load(args.model, progress=not args.json)
    settle_threads(args)
    reference = hf_reference(args.model, language_model.model, language_model.tokenizer).to(device)
    ids = torch.tensor([language_model.encode(prompt)], device=device)
    language_model.to(device)
    result = compare(language_model.model, reference, ids, args.atol, args.rtol)
    failure = result.first_failure
    if args.json:
        print(json.dumps(result.to_dict() | {"model": args.model, "reference": args.reference}))
        return 0 if failure is None else 1
    print(f"{'place':<24} {'max |diff|':>11} {'tolerance':>10} {'max |ref|':>10}")
    for s in result.sites:
        mark = "" if s.ok else "  <- exceeds"
        print(f"{s.site:<24} {s.max_abs_diff:>11.3e} {s.tolerance:>10.1e} {s.reference_max:>10.3g}{mark}")
    if failure is None:
        print(f"all {len(result.sites)} places within tolerance ({result.n_tokens} tokens)")
        return 0
    print(f"first place exceeding tolerance: {failure.site}")
    return 1
