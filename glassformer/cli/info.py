"""`glassformer info`: a model, a preset or a configuration: its family and pieces, its
settings, where its parameters are and, for a model, its tokenizer and its file's format and
metadata."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..errors import InputError
from ..formats import hub
from ..formats.export import hf_config
from ..formats.families import BY_GGUF, BY_MODEL_TYPE
from ..formats.files import read_json_object
from ..interpret.params import count_parameters
from ..model.config import ModelConfig
from ..model.encoder_decoder import build_model
from ..model.pieces import pieces
from ..model.presets import get_preset
from .options import add

LONGEST_LIST, LONGEST_TEXT = 8, 80  # metadata values longer than these are summarised
_LISTED = ("metadata", "tensor_groups", "tensors")  # sections printed as lists of their own (text)
# Where a model's family was read, as the text output says it
FAMILY_SOURCES = {"model_type": "as its config.json's model_type says",
                  "general.architecture": "as its GGUF architecture says",
                  "export": "the family `export --format hf` writes it as"}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "info", help="describe a model, a preset, a configuration, or this CPU",
        description="Print a model's family and pieces, its configuration and its parameter "
                    "counts; for --model also its "
                    "tokenizer (its BOS rule and end ids) and its file's format and metadata (a "
                    "GGUF file's key/values and tensor types, with what the default load and "
                    "--quantize gguf do with each, read from its header alone; a "
                    "Hugging Face config.json, a checkpoint's training settings); for --cpu "
                    "this CPU and the fast paths measured on it.")
    source = parser.add_mutually_exclusive_group(required=True)
    add(source, "--model", "--preset", "--config")
    source.add_argument("--cpu", action="store_true",
                        help="this CPU and the fast paths measured on it")
    add(parser, "--json")
    parser.set_defaults(run=run)


def load_config(preset: str | None, path: str | None) -> ModelConfig:
    if preset is not None:
        return get_preset(preset)
    values = read_json_object(path)
    try:
        return ModelConfig.from_dict(values.get("model", values))
    except InputError as error:
        raise InputError(path, f"{error}") from None


def run(args: argparse.Namespace) -> int:
    if args.cpu:
        return show_system(args.json)
    gguf = None if args.model is None else gguf_file(args.model, progress=not args.json)
    if gguf is not None:  # the header alone: no tensor is read
        from ..formats.gguf_summary import summarize_gguf

        summary = summarize_gguf(gguf)
        config = summary.config
        with torch.device("meta"):
            model = build_model(config)
        tokenizer = describe_tokenizer(summary.tokenizer)
        described = {"file": describe_gguf(gguf, summary),
                     "tokenizer": {"tokenizer": tokenizer.pop("tokenizer"), "kind": summary.tokenizer_kind,
                                   "pre_tokenizer": summary.pre_tokenizer, **tokenizer}}
    elif args.model is not None:
        from ..language_model import load  # imported here: loading pulls in every loader

        language_model = load(args.model, progress=not args.json)
        config, model = language_model.config, language_model.model
        described = {"file": describe_file(args.model),
                     "tokenizer": describe_tokenizer(language_model.tokenizer)}
    else:
        config = load_config(args.preset, args.config)
        with torch.device("meta"):  # shapes only: no memory, no initialisation cost
            model = build_model(config)
        described = {}
    counts = count_parameters(model)
    stacks = stack_summary(config)
    family = describe_family(config, described.get("file"))
    parts = [{"name": name, "values": values} for name, values in pieces(config)]
    if args.json:
        print(json.dumps({"family": family, "pieces": parts, "config": config.to_dict(),
                          "parameters": counts, "stacks": stacks, **described}))
        return 0
    for section in ("file", "tokenizer"):
        if section in described:
            _print_fields({k: v for k, v in described[section].items() if k not in _LISTED})
            for key, value in described[section].get("metadata", {}).items():
                print(f"{key:>40}  {value}")
            _print_tensor_groups(described[section].get("tensor_groups", []))
            print()
    if config.n_encoder_layers or not config.causal:  # the stacks first, then the family
        for stack in stacks:
            print(f"{stack['name']:>24}  {stack['layers']} blocks: {', '.join(stack['sublayers'])}")
        print()
    print(f"{'family':>24}  " + ("none of the supported families" if family is None else
          f"{family['name']} (model_type {family['model_type']}, GGUF {family['gguf'] or '-'}), "
          f"{FAMILY_SOURCES[family['from']]}"))
    for i, piece in enumerate(parts):
        values = f": {piece['values']}" if piece["values"] else ""
        print(f"{'pieces' if i == 0 else '':>24}  {piece['name']}{values}")
    print()
    _print_fields(config.to_dict())
    print()
    width = max(24, *map(len, counts))
    for component, count in counts.items():
        print(f"{component:>{width}}  {count:,}")
    return 0


def _print_fields(fields: dict) -> None:
    for field, value in fields.items():
        print(f"{field:>24}  {value}")


def _print_tensor_groups(groups: list[dict]) -> None:
    """One line per tensor type and what --quantize gguf does with it (the default load:
    float32 for all)."""
    from ..formats.gguf_summary import KEPT

    if groups:
        print(f"\n{'tensors':>24}  the default load makes every tensor float32; --quantize gguf:")
    for group in groups:
        count = f"{group['tensors']} tensor{'s' if group['tensors'] > 1 else ''}"
        action = "" if group["quantize_gguf"] == KEPT else "float32: "
        print(f"{group['type']:>24}  {count}, {_size(group['bytes'])}: {action}{group['why']}")


def _size(n_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes} bytes"


def gguf_file(source: str, progress: bool) -> Path | None:
    """The GGUF file --model names (a file, or a known model's, fetched as load does), else
    None (a folder, or a path load will refuse with its own message)."""
    path = Path(source).expanduser()
    if not path.exists() and source in hub.MODELS:
        return hub.model_path(source, progress=progress)
    if path.is_file():
        with open(path, "rb") as f:
            return path if f.read(4) == b"GGUF" else None
    return None


def describe_gguf(path: Path, summary) -> dict:
    """A GGUF file's size, metadata (long values summarised) and tensors: each one's type,
    shape, bytes and what --quantize gguf does with it (and why), and those grouped by type."""
    from ..formats.gguf_summary import FLOAT32, tensor_groups

    types: dict[str, int] = {}
    for tensor in summary.tensors:
        types[tensor["type"]] = types.get(tensor["type"], 0) + 1
    return {"format": "gguf", "path": str(path), "bytes": path.stat().st_size, "tensor_types": types,
            "default_load": FLOAT32, "tensor_groups": tensor_groups(summary.tensors),
            "tensors": summary.tensors, "metadata": _summarised(summary.metadata)}


def describe_file(source: str) -> dict:
    """The format of a model's folder and its metadata (long values summarised); a GGUF
    file's: describe_gguf."""
    from ..formats.checkpoint import Checkpoint

    path = Path(source).expanduser()
    config = read_json_object(path / "config.json") if (path / "config.json").is_file() else {}
    files = sorted(p.name for p in path.iterdir())
    if "model_type" in config:
        return {"format": "huggingface", "path": str(path), "files": files,
                "metadata": _summarised(config)}
    checkpoint = Checkpoint.open(path)
    meta = {k: v for k, v in checkpoint.meta.items() if k != "model"}  # the model: printed as config
    return {"format": "glassformer checkpoint", "path": str(checkpoint.folder),
            "files": sorted(p.name for p in checkpoint.folder.iterdir()), "metadata": _summarised(meta)}


def describe_family(config: ModelConfig, file: dict | None) -> dict | None:
    """The model's family (formats/families.py): the one its file names (a config.json's
    model_type, a GGUF file's architecture), else the one `export --format hf` writes it as;
    None for a configuration no family expresses."""
    meta = (file or {}).get("metadata", {})
    found, source = None, "export"
    if file is not None and file["format"] == "gguf":
        found, source = BY_GGUF.get(str(meta.get("general.architecture"))), "general.architecture"
    elif file is not None and file["format"] == "huggingface":
        found, source = BY_MODEL_TYPE.get(str(meta.get("model_type"))), "model_type"
    if found is None:
        try:
            found, source = BY_MODEL_TYPE.get(hf_config(config)["model_type"]), "export"
        except InputError:  # no family's config.json can say it
            return None
    return {"name": found.name, "model_type": found.model_type,
            "gguf": found.gguf and found.gguf.name, "from": source}


def describe_tokenizer(tokenizer) -> dict:
    """The tokenizer's kind, vocabulary size, special token ids, its BOS rule (whether each
    text starts with BOS, and which), the ids that end a reply and whether it has a chat
    template."""
    table = getattr(tokenizer, "tokenizer", None)  # a tokenizers.Tokenizer, where there is one
    ends = sorted(tokenizer.end_ids)
    return {"tokenizer": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id, "bos_id": getattr(tokenizer, "bos_id", None),
            "mask_id": getattr(tokenizer, "mask_id", None),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "add_bos": bool(getattr(tokenizer, "add_bos", False)),
            "bos_token": getattr(tokenizer, "bos_token", None), "bos_rule": _bos_rule(tokenizer),
            "end_ids": ends,
            "end_tokens": [table.id_to_token(i) for i in ends] if table is not None else None}


def _bos_rule(tokenizer) -> str:
    """What encoding a text puts before it, in words."""
    if not getattr(tokenizer, "add_bos", False):
        return "no BOS before a text"
    if tokenizer.bos_id is None:
        return "BOS asked for, but no BOS token named: none before a text"
    return f"{tokenizer.bos_token!r} (id {tokenizer.bos_id}) before each text"


def _summarised(values: dict) -> dict:
    """Flattened one level (train.lr) with long lists and texts replaced by a description."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat |= {f"{key}.{k}": v for k, v in _summarised(value).items()}
        elif isinstance(value, list | tuple) and len(value) > LONGEST_LIST:
            flat[key] = f"[{len(value)} items]"
        elif isinstance(value, str) and len(value) > LONGEST_TEXT:
            flat[key] = f"{value[:LONGEST_TEXT]!r}... ({len(value)} characters)"
        else:
            flat[key] = value
    return flat


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
