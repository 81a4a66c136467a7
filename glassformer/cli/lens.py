"""`glassformer lens`: what each layer predicts (logit or tuned lens); `glassformer lens train`
fits a tuned lens."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..errors import InputError
from ..formats.files import check_location, check_output, read_text, write_atomic
from ..interpret.lens import LensTraining, TunedLens, held_out, kl_curve, logit_lens, train_tuned_lens
from ..interpret.lens_page import lens_data, render_html
from ..language_model import load
from .options import (
    add,
    add_computing,
    add_prompt,
    finite,
    positive_int,
    read_prompt,
    settle_threads,
)

TRAIN = "train"  # the first word that makes this the training command
TRAINING_FLAGS = ("data", "out", "steps", "batch", "context", "lr")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    defaults = LensTraining()
    parser = subparsers.add_parser(
        "lens", help="the logit / tuned lens: each layer's top tokens; `lens train` fits a tuned lens",
        description="glassformer lens --model M PROMPT: read each layer's residual stream through "
                    "the model's final norm and head (with --tuned DIR, through a tuned lens's maps "
                    "first) and print the top token and its probability per layer and position. "
                    "glassformer lens train --model M --data FILE --out DIR: fit a tuned lens "
                    "(one affine map per layer) on FILE against the model's final distribution.",
    )
    add_prompt(parser, f"the prompt to read (or the word {TRAIN!r} to train a tuned lens)")
    add(parser, "--model", required=True)
    add(parser, "--top-k", "--force", "--json")  # lens: 5 tokens by default; --force: over --html
    parser.add_argument("--tuned", help="a tuned lens folder written by `glassformer lens train`")
    parser.add_argument("--html", help="also write a heat map of layers x tokens to this HTML file")
    add_computing(parser)
    train = parser.add_argument_group(f"training (glassformer lens {TRAIN})")
    add(train, "--data", "--out")  # one text file (its last tenth measures); the lens's folder
    train.add_argument("--steps", type=positive_int, help=f"optimizer steps (default {defaults.steps})")
    train.add_argument("--batch", type=positive_int, help=f"windows per step (default {defaults.batch})")
    train.add_argument("--lens-context", type=positive_int, dest="context",
                       help=f"tokens per window, at most the model's context (default "
                            f"{defaults.context}, or the model's context if shorter)")
    train.add_argument("--lens-lr", type=finite, dest="lr",
                       help=f"Adam's learning rate for the lens (default {defaults.lr})")
    add(train, "--seed")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    args.device, args.top_k = args.device or "cpu", args.top_k or 5
    if args.prompt == TRAIN and args.prompt_file is None:
        return _train(args)
    given = [f"--{flag}" for flag in TRAINING_FLAGS if getattr(args, flag) is not None]
    if given:
        raise InputError(given[0], f"only for `glassformer lens {TRAIN}`")
    text = read_prompt(args)
    if args.html is not None:  # refused before the model is read
        check_output(args.html, [args.model], args.force)
    loaded = load(args.model).to(args.device)
    settle_threads(args)
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    tuned = TunedLens.load(args.tuned).to(args.device) if args.tuned is not None else None
    ids = loaded.encode(text)
    if not ids:
        raise InputError("prompt", "it encodes to no tokens")
    lens = logit_lens(model, torch.tensor([ids], device=args.device), args.top_k, tuned)
    data = lens_data(lens, ids, lambda i: tokenizer.decode([i]), tuned is not None)
    if args.html is not None:
        write_atomic(args.html, render_html(data))
    if args.json:
        print(json.dumps(data, ensure_ascii=False))
    else:
        _print_table(data)
        if args.html is not None:
            print(f"wrote {args.html}")
    return 0


def _print_table(data: dict) -> None:
    """Layers down (the output last), positions across: each cell the top token and its probability."""
    cells = [[repr(t) for t in data["tokens"]]] + [
        [f"{top[0]['token']!r} {top[0]['prob']:.2f}" for top in layer["top"]] for layer in data["layers"]
    ]
    labels = ["token"] + [layer["site"] for layer in data["layers"]]
    widths = [max(len(row[j]) for row in cells) for j in range(len(cells[0]))]
    label_width = max(map(len, labels))
    for label, row in zip(labels, cells, strict=True):
        print(f"{label:<{label_width}}  " + "  ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=True)))


def _train(args: argparse.Namespace) -> int:
    if args.data is None or args.out is None:
        raise InputError(None,
                         f"--{'data' if args.data is None else 'out'}: `glassformer lens {TRAIN}` needs it")
    for flag in ("tuned", "html"):
        if getattr(args, flag) is not None:
            raise InputError(f"--{flag}", f"not for `glassformer lens {TRAIN}` (it reads a prompt)")
    if len(args.data) != 1:
        raise InputError("--data", f"`glassformer lens {TRAIN}` reads one text file, got {len(args.data)}")
    data = args.data[0]
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError("--out", f"{out} is a file; give a folder")
    check_location(out, makes_folders=True)
    settings = LensTraining(**{k: v for k, v in (("steps", args.steps), ("batch", args.batch),
                               ("context", args.context), ("lr", args.lr)) if v is not None},
                            **({} if args.seed is None else {"seed": args.seed}))
    text = read_text(data)
    loaded = load(args.model).to(args.device)
    settle_threads(args)
    model = loaded.model.eval()
    if settings.context > model.config.context_length:  # before the text is encoded
        if args.context is not None:
            raise InputError("--lens-context", f"{settings.context} is above {args.model}'s "
                             f"context length, {model.config.context_length}")
        settings = replace(settings, context=model.config.context_length)  # the default's cap
    tokens = torch.tensor(loaded.encode(text), dtype=torch.long)
    if len(tokens) < 2:
        raise InputError("--data", f"{data} holds {len(tokens)} tokens; a tuned lens needs more")
    context = min(settings.context, model.config.context_length, len(tokens))
    train, measure = held_out(tokens, context)
    measure = measure.to(args.device)

    def progress(step: int, loss: float) -> None:
        args.thread_policy.revisit()  # a long run: follow what other processes leave free
        if step == 1 or step % 10 == 0 or step == settings.steps:
            print(f"lens train: step {step}/{settings.steps}, KL summed over layers {loss:.4f}",
                  file=sys.stderr, flush=True)

    tuned = train_tuned_lens(model, train, settings, progress)
    curves = {"logit_lens": kl_curve(model, measure).tolist(),
              "tuned_lens": kl_curve(model, measure, tuned).tolist()}
    about = {"model": args.model, "data": str(data), "train_tokens": len(train),
             "measured_tokens": measure.numel(), "training": asdict(settings), "kl": curves}
    tuned.save(out, about)
    if args.json:
        print(json.dumps({"out": str(out), **about}))
    else:
        for name, curve in curves.items():
            print(f"{name:<10} KL per layer: " + " ".join(f"{v:.3f}" for v in curve))
        print(f"wrote {out}: {model.config.n_layers} maps, trained on {len(train)} tokens")
    return 0
