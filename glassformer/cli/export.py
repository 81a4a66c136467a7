"""`glassformer export`: write a model in another library's format (a Hugging Face folder)."""

from __future__ import annotations

import argparse
import json

from .options import add


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help="write a model as a Hugging Face folder")
    add(parser, "--model", required=True)
    parser.add_argument("--format", choices=("hf",), default="hf",
                        help="hf: config.json + model.safetensors + tokenizer, for transformers")
    add(parser, "--output", required=True)
    parser.add_argument("--merge-lora", metavar="ADAPTER",
                        help="a LoRA adapter folder (PEFT layout, or a LoRA run) for --model, "
                             "folded into its weights")
    add(parser, "--json")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..formats.export import export_hf
    from ..language_model import load

    language_model = load(args.model)
    if args.merge_lora:
        from ..training.lora import apply_adapter, merge_lora

        apply_adapter(language_model.model, args.merge_lora, base=args.model)
        merge_lora(language_model.model)
    folder = export_hf(language_model.model, language_model.tokenizer, args.output)
    files = sorted(p.name for p in folder.iterdir())
    if args.json:
        print(json.dumps({"output": str(folder), "format": args.format, "files": files}))
    else:
        print(f"wrote {folder}: {', '.join(files)}")
    return 0
