"""`glassformer export`: write a model in another library's format (a Hugging Face folder, or
a GGUF file for llama.cpp)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import InputError
from ..formats.files import check_location
from .options import add


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help="write a model as a Hugging Face folder or "
                                                  "a GGUF file")
    add(parser, "--model", required=True)
    parser.add_argument("--to", "--format", dest="format", choices=("hf", "gguf"), default="hf",
                        help="hf: config.json + model.safetensors + tokenizer, for transformers; "
                             "gguf: one file for llama.cpp-based tools")
    add(parser, "--output")
    parser.add_argument("destination", nargs="?", metavar="OUT",
                        help="where to write (or --output)")
    add(parser, "--dtype")
    parser.add_argument("--merge-lora", metavar="ADAPTER",
                        help="a LoRA adapter folder (PEFT layout, or a LoRA run) for --model, "
                             "folded into its weights")
    add(parser, "--force", "--json")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..formats.export import export_hf
    from ..formats.gguf_export import DTYPES, export_gguf
    from ..language_model import load

    if (args.output is None) == (args.destination is None):
        raise InputError("output", "give where to write once (OUT or --output)")
    output = args.output or args.destination
    if args.format == "gguf" and (args.dtype or "f32") not in DTYPES:
        raise InputError("dtype", f"unknown {args.dtype!r} for gguf; choose one of {', '.join(DTYPES)}")
    if args.format == "hf" and args.dtype is not None:
        raise InputError("dtype", "a Hugging Face folder is written in the model's float32; "
                         "--dtype is for --to gguf")
    if args.format == "gguf" and Path(output).exists() and not args.force:
        raise InputError("output", f"{output} exists (pass --force to replace it)")
    if args.format == "hf" and Path(output).exists() and (not Path(output).is_dir()
                                                          or any(Path(output).iterdir())):
        raise InputError("output", f"{output} exists and is not an empty folder")
    check_location(output, makes_folders=True)  # all before the model is read
    language_model = load(args.model)
    if args.merge_lora:
        from ..training.lora import apply_adapter, merge_lora

        apply_adapter(language_model.model, args.merge_lora, base=args.model)
        merge_lora(language_model.model)
    if args.format == "gguf":
        written = export_gguf(language_model.model, language_model.tokenizer, output,
                              args.dtype or "f32", force=args.force)
        files = [written.name]
    else:
        written = export_hf(language_model.model, language_model.tokenizer, output)
        files = sorted(p.name for p in written.iterdir())
    if args.json:
        print(json.dumps({"output": str(written), "format": args.format, "files": files,
                          "dtype": args.dtype or ("f32" if args.format == "gguf" else "float32")}))
    else:
        print(f"wrote {written}: {', '.join(files)}")
    return 0
