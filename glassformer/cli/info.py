"""`glassformer info`: a configuration and where its parameters are."""

from __future__ import annotations

import argparse
import json

import torch

from ..formats.files import read_json_object
from ..interpret.params import count_parameters
from ..model.config import ModelConfig
from ..model.encoder_decoder import build_model
from ..model.presets import get_preset


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("info", help="show a configuration and its parameter counts")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help="a named preset, e.g. gpt2")
    source.add_argument("--config", help="a JSON file of ModelConfig fields")
    source.add_argument("--system", action="store_true",
                        help="this CPU and the fast paths measured on it")
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


def run(args: argparse.Namespace) -> int:
    if args.system:
        return show_system(args.json)
    config = load_config(args.preset, args.config)
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = build_model(config)
    counts = count_parameters(model)
    stacks = stack_summary(config)
    if args.json:
        print(json.dumps({"config": config.to_dict(), "parameters": counts, "stacks": stacks}))
        return 0
    if config.n_encoder_layers or not config.causal:  # the stacks first
        for stack in stacks:
            print(f"{stack['name']:>24}  {stack['layers']} blocks: {', '.join(stack['sublayers'])}")
        print()
    for field, value in config.to_dict().items():
        print(f"{field:>24}  {value}")
    print()
    width = max(24, *map(len, counts))
    for component, count in counts.items():
        print(f"{component:>{width}}  {count:,}")
    return 0


def stack_summary(config: ModelConfig) -> list[dict]:
    """The model's stacks (one for a decoder-only model, encoder and decoder otherwise): name,
    number of blocks, and the sublayers of each block."""
    self_attention = "causal self-attention" if config.causal else "bidirectional self-attention"
    if not config.n_encoder_layers:  # one stack: a decoder, or an encoder (BERT)
        return [{"name": "decoder" if config.causal else "encoder", "layers": config.n_layers,
                 "sublayers": [self_attention, "feed-forward"]}]
    return [{"name": "encoder", "layers": config.n_encoder_layers,
             "sublayers": ["bidirectional self-attention", "feed-forward"]},
            {"name": "decoder", "layers": config.n_layers,
             "sublayers": ["causal self-attention", "cross-attention to the encoder", "feed-forward"]}]


def show_system(as_json: bool) -> int:
    """The CPU line and each CPU-dependent decision: choice, source, measured seconds."""
    from ..accel import decisions, onednn
    from ..accel.cpu import cpu_features

    cpu, made = cpu_features().summary(), [d.to_dict() for d in (
        decisions.bf16_products(), onednn.onednn_products(), decisions.kernel_target())]
    if as_json:
        print(json.dumps({"cpu": cpu, "decisions": made}))
        return 0
    print(f"{'cpu':>16}  {cpu}")
    for d in made:
        figures = ", ".join(f"{option} {seconds * 1e3:.2f} ms" for option, seconds in d["figures"].items())
        print(f"{d['name']:>16}  {d['choice']} ({d['source']}{': ' if d['note'] else ''}{d['note']})"
              + (f"; {figures}" if figures else ""))
    return 0
