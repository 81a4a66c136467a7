"""`glassformer train`: argument parsing around glassformer.training.loop.train."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import typing
from pathlib import Path

from tqdm import tqdm

from ..errors import InputError
from ..formats.checkpoint import Checkpoint, resume_source
from ..formats.files import read_json_object
from ..model.config import ModelConfig
from ..model.presets import PRESETS
from ..training.config import RECIPES, TrainConfig
from .options import FLAGS, add, add_threads
from .waits import announce


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="train a model on text files",
        description="Train a model on text. Every ModelConfig and TrainConfig field can be "
                    "overridden (--n-layers 4 --d-model 128 --batch-size 12 --lr 1e-3 ...). "
                    f"--preset takes a recipe ({', '.join(RECIPES)}) or a model preset.",
    )
    add(parser, "--data", "--out", required=True)
    add(parser.add_mutually_exclusive_group(), "--preset", "--config")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out")
    add(parser, "--no-progress", "--json")
    model_args = parser.add_argument_group("model (ModelConfig fields)")
    _add_fields(model_args, ModelConfig, skip={"vocab_size"}, prefix="model.")
    train_args = parser.add_argument_group("training (TrainConfig fields)")
    _add_fields(train_args, TrainConfig, skip=set(), prefix="train.")
    add_threads(parser)
    parser.set_defaults(run=run)


def _add_fields(group, cls, skip: set[str], prefix: str) -> None:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flag, dest = "--" + field.name.replace("_", "-"), prefix + field.name
        kind = hints[field.name]
        args = typing.get_args(kind)
        if flag in FLAGS:  # one the other commands share (--seed, --device, ...): defined there
            add(group, flag, dest=dest)
        elif kind is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None)
        elif typing.get_origin(kind) is typing.Literal:
            group.add_argument(flag, dest=dest, choices=args, default=None)
        else:
            base = next((a for a in args if a is not type(None)), kind)  # X | None -> X
            group.add_argument(flag, dest=dest, type=_optional(base), default=None,
                               metavar=base.__name__.upper())


def _optional(base):
    def parse(text: str):
        return None if text.lower() == "none" else base(text)

    parse.__name__ = base.__name__
    return parse


# Fields set by a table flag that only switches on (store_true): unset, False means "not given",
# so a recipe's own value stands (shakespeare-char-gpu compiles without --compile).
SWITCHES = frozenset({"train.compile"})


def _overrides(args: argparse.Namespace, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in vars(args).items()
            if k.startswith(prefix) and v is not None and not (k in SWITCHES and v is False)}


def _base_configs(args: argparse.Namespace) -> tuple[dict, dict]:
    """(model dict, train dict) before the command-line overrides."""
    if args.config:
        data = read_json_object(args.config)
        model, train = data.get("model"), data.get("train", {})
        if not isinstance(model, dict) or not isinstance(train, dict):
            raise InputError(args.config, "expected {\"model\": {...}, \"train\": {...}} "
                             "(objects of ModelConfig and TrainConfig fields)")
        return dict(model), dict(train)
    if args.preset is None and args.resume and Path(args.out).exists():
        checkpoint = Checkpoint.open(resume_source(Path(args.out)))  # the saved settings by default
        return checkpoint.config.to_dict(), dict(checkpoint.meta["train"])
    if args.preset is None and getattr(args, "train.init") is not None:
        return {}, {}  # the pretrained model's config
    name = args.preset or "shakespeare-char"
    if name in RECIPES:
        return RECIPES[name].model.to_dict(), RECIPES[name].train.to_dict()
    if name in PRESETS:
        return PRESETS[name].to_dict(), {}
    known = ", ".join(sorted(RECIPES) + sorted(PRESETS))
    raise InputError(None, f"unknown preset {name!r}; known: {known}")


def run(args: argparse.Namespace) -> int:
    from ..training.loop import train  # the loop pulls in torch.distributed; only load it when training

    model, train_values = _base_configs(args)
    try:
        train_config = TrainConfig.from_dict({**train_values, **_overrides(args, "train.")})
        model_config = {**model, **_overrides(args, "model.")}  # checked against --init's model
        if train_config.init is None:
            model_config = ModelConfig.from_dict({"vocab_size": 1, **model_config})  # the tokenizer's
    except InputError as error:
        if args.config:  # the file's field, named with the file
            raise InputError(args.config, str(error)) from None
        raise
    lora_flags = [k for k in _overrides(args, "train.") if k.startswith("lora_")]
    if train_config.lora_rank is None and lora_flags:  # even at their defaults: never ignored
        raise InputError(lora_flags[0], f"--{lora_flags[0].replace('_', '-')} applies to LoRA: "
                         "give --lora-rank too")
    echo = (lambda s: tqdm.write(s, file=sys.stderr)) if args.json else tqdm.write
    summary = train(args.data, args.out, model_config, train_config, resume=args.resume,
                    progress=not args.no_progress, echo=echo, threads=args.thread_policy,
                    announce=announce)
    if summary["rank"] != 0:  # under torchrun, rank 0 speaks for all
        return 0
    if args.json:
        print(json.dumps(_finite(summary)))
    else:
        print(f"trained {summary['iters']} iterations: val loss {summary['val_loss']:.4f}, "
              f"{summary['tokens_per_second']:,.0f} tokens/s, checkpoint {summary['checkpoint']}")
    return 0


def _finite(summary: dict) -> dict:
    """JSON has no NaN or infinity: write null instead."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in summary.items()}
