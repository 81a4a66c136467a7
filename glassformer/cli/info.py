"""`glassformer info`: a configuration and where its parameters are."""

from __future__ import annotations

import argparse
import json

import torch

from ..formats.files import read_json_object
from ..interpret.params import count_parameters
from ..model.config import ModelConfig
from ..model.presets import get_preset
from ..model.transformer import Transformer


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("info", help="show a configuration and its parameter counts")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help="a named preset, e.g. gpt2")
    source.add_argument("--config", help="a JSON file of ModelConfig fields")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def load_config(preset: str | None, path: str | None) -> ModelConfig:
    if preset is not None:
        return get_preset(preset)
    values = read_json_object(path)
    try:
        return ModelConfig.from_dict(values.get("model", values))
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def stack(config: ModelConfig) -> str:
    """What the blocks are: a decoder (causal attention) or an encoder (bidirectional)."""
    return "decoder" if config.causal else "encoder"


def run(args: argparse.Namespace) -> int:
    config = load_config(args.preset, args.config)
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = Transformer(config)
    counts = count_parameters(model)
    if args.json:
        print(json.dumps({"config": config.to_dict(), "stack": stack(config), "parameters": counts}))
        return 0
    print(f"{'stack':>24}  {stack(config)}")
    for field, value in config.to_dict().items():
        print(f"{field:>24}  {value}")
    print()
    for component, count in counts.items():
        print(f"{component:>24}  {count:,}")
    return 0
