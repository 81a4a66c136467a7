"""Hugging Face model folders (config.json, *.safetensors [+ index], tokenizer.json) -> Glassformer.

A folder's `model_type` names its family (the registry, families.py), whose reader turns
config.json into a ModelConfig and whose key map pairs each Hugging Face tensor with ours: stacked
into our fused `qkv` and `mlp.up`, transposed (GPT-2's Conv1D), reordered (NeoX's per-head
query_key_value). Every key and shape is checked, then the weights load with
`load_state_dict(strict=True)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..errors import InputError
from ..model.config import ModelConfig
from ..model.encoder_decoder import EncoderDecoder, build_model
from ..model.sizes import check_model_fits
from ..model.transformer import Transformer
from .chat_tokenizer import ChatTokenizer
from .empty_model import empty_model
from .families import family_of
from .files import read_json_object
from .tensor_map import Entry
from .validate import check_model, check_tensor

# Buffers some transformers versions save, carrying no weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq",
                     ".attention.bias", ".attention.masked_bias")


# The keys of config.json that families write each ModelConfig size under (the first one a
# file holds names it in a message).
HF_NAMES = {
    "vocab_size": ("vocab_size",), "context_length": ("max_position_embeddings", "n_positions"),
    "d_model": ("hidden_size", "n_embd", "d_model"),
    "n_layers": ("num_hidden_layers", "n_layer", "num_decoder_layers", "num_layers"),
    "n_heads": ("num_attention_heads", "n_head", "num_heads"), "n_kv_heads": ("num_key_value_heads",),
    "d_head": ("head_dim", "d_kv"), "d_ff": ("intermediate_size", "n_inner", "d_ff"),
    "norm_eps": ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"),
    "n_encoder_layers": ("num_layers",), "n_token_types": ("type_vocab_size",),
    "rotary_dim": ("partial_rotary_factor", "rotary_pct"), "sliding_window": ("sliding_window",),
    "relative_buckets": ("relative_attention_num_buckets",),
    "relative_max_distance": ("relative_attention_max_distance",),
}


def in_file(error: InputError, hf: dict[str, Any], where: str | Path) -> InputError:
    """`error` about one of our fields, told as the config.json key the user wrote (its field,
    our name beside it in the message) and the file."""
    written = next((k for k in HF_NAMES.get(error.field or "", ()) if k in hf), error.field)
    ours = f"our {error.field}, " if written != error.field else ""
    return InputError(written, f"{error.detail} ({ours}in {where})", error.code)


def config_from_hf(hf: dict[str, Any], pooler: bool = False, where: str | Path = "config.json",
                   ) -> ModelConfig:
    """A ModelConfig equal to a Hugging Face config.json (as a dict); `pooler`: the weights
    hold BERT's pooler; `where`: the file, which every refusal names with the key it blames."""
    kind = hf.get("model_type")
    try:
        family = family_of(kind)
        config = family.read(hf)
    except KeyError as error:
        raise InputError(None, f"{where} lacks {error.args[0]!r} for model_type {kind!r}") from None
    except InputError as error:
        raise in_file(error, hf, where) from None
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as error:  # a value of another type
        raise InputError(None, f"{where}: a value this model_type ({kind!r}) cannot take "
                         f"({type(error).__name__}: {error})") from None
    return config.replace(pooler=True) if pooler else config


def check_sizes(hf: dict[str, Any], config: ModelConfig, tensors: dict[str, torch.Tensor],
                where: Path, dtype: torch.dtype = torch.float32) -> None:
    """Before any weight is allocated: the config's sizes fit the machine and give the shapes
    the file's tensors have (checked on a model without storage, on the meta device)."""
    try:
        check_model_fits(config, dtype=dtype)
    except InputError as error:
        raise in_file(error, hf, where) from None
    with torch.device("meta"):
        shapes = build_model(config)  # parameters without memory: their shapes alone
    try:
        state_dict(config, hf["model_type"], tensors, shapes)
    except InputError as error:
        raise InputError(where.parent, f"{error.detail} (as {where.name} describes it)") from None


def load_hf(folder: str | Path, dtype: torch.dtype = torch.float32,
            ) -> tuple[Transformer | EncoderDecoder, ChatTokenizer]:
    """Read a Hugging Face model folder: the model (eval mode, on CPU) and its tokenizer."""
    hf, config = read_config(folder)
    tokenizer = ChatTokenizer.load(folder)
    check_vocabulary(tokenizer, config, folder)  # before the weights: the likelier mistake
    return load_hf_model(folder, dtype, (hf, config)), tokenizer


def read_config(folder: str | Path) -> tuple[dict, ModelConfig]:
    """A folder's config.json as read, and as a ModelConfig (refused if it cannot be read)."""
    config_path = Path(folder) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (not a Hugging Face model folder)")
    hf = read_json_object(config_path)
    return hf, config_from_hf(hf, where=config_path)


def load_hf_model(folder: str | Path, dtype: torch.dtype = torch.float32,
                  configs: tuple[dict, ModelConfig] | None = None) -> Transformer | EncoderDecoder:
    """The model of a Hugging Face folder alone (eval mode, on CPU), for folders without a
    tokenizer; `configs` is read_config's answer where it was read already."""
    folder = Path(folder)
    hf, config = configs or read_config(folder)
    tensors = read_safetensors(folder)
    if family_of(hf["model_type"]).pooler_key in tensors:  # BERT's pooler, where the file holds one
        config = config_from_hf(hf, pooler=True, where=folder / "config.json")
    check_sizes(hf, config, tensors, folder / "config.json", dtype)
    model = empty_model(config, dtype)
    try:
        weights = state_dict(config, hf["model_type"], tensors, model)
    except ValueError as error:
        raise InputError(folder, f"{error}") from None
    model.load_state_dict(weights, strict=True)
    check_model(model, str(folder), parameters=False)
    return model.eval()


def check_vocabulary(tokenizer, config: ModelConfig, where: Path) -> None:
    """Every id the tokenizer can produce (special ones included) has a row in the model."""
    ids = [tokenizer.vocab_size - 1, tokenizer.eos_id, tokenizer.bos_id]
    top = max(i for i in ids if i is not None)
    if top >= config.vocab_size:
        raise InputError(where, f"the tokenizer has ids up to {top} but the model's vocabulary "
                         f"has {config.vocab_size} rows: they do not belong together")


def state_dict(config: ModelConfig, model_type: str, tensors: dict[str, torch.Tensor],
               model: Transformer | EncoderDecoder) -> dict[str, torch.Tensor]:
    """Our state dict from the Hugging Face tensors, after strict name and shape checks."""
    family = family_of(model_type)
    entries = family.keys(config)
    prefix = family.prefix
    if prefix and not any(k.startswith(prefix) for k in tensors):  # original GPT-2 files omit it
        tensors = {prefix + k if k != "lm_head.weight" else k: v for k, v in tensors.items()}
    wanted = {e.hf for e in entries}
    missing = sorted(wanted - set(tensors))
    if missing:
        raise InputError(None, f"missing tensor {missing[0]} ({len(missing)} missing in all)")
    tied = family.copies(config)  # copies of tied tensors a file may hold beside the originals
    unknown = sorted(k for k in set(tensors) - wanted
                     if not k.endswith(_IGNORED_SUFFIXES) and k not in tied)
    if unknown:
        raise InputError(None, f"unexpected tensor {unknown[0]} for this {model_type} configuration")
    params = dict(model.state_dict())
    parts: dict[str, list[tuple[Entry, torch.Tensor]]] = {}
    for e in entries:
        if not tensors[e.hf].is_floating_point():
            raise InputError(None, f"tensor {e.hf} holds {tensors[e.hf].dtype} values; weights are "
                             "floating point")
        check_tensor(tensors[e.hf], e.hf, "weights")
        t = tensors[e.hf].T if e.transpose else tensors[e.hf]
        target = params[e.ours].shape
        shape = (e.rows[1] - e.rows[0], *target[1:]) if e.rows else tuple(target)
        if tuple(t.shape) != tuple(shape):
            raise InputError(None, f"tensor {e.hf} has shape {tuple(tensors[e.hf].shape)}, "
                             f"expected {tuple(shape)}{' transposed' if e.transpose else ''}")
        parts.setdefault(e.ours, []).append((e, t if e.order is None else t[list(e.order)]))
    out = {}
    for name, pieces in parts.items():
        pieces.sort(key=lambda p: p[0].rows or (0, 0))
        out[name] = pieces[0][1] if len(pieces) == 1 else torch.cat([t for _, t in pieces])
    if config.tie_embeddings:
        out["lm_head.weight"] = out["embed.tokens.weight"]
    return out


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed in model.safetensors.index.json."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise InputError(index, "lacks a weight_map object")
        files = sorted(set(map(str, weight_map.values())))
    else:
        files = [p.name for p in sorted(folder.glob("*.safetensors"))]
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: shard {name} listed in the index is missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except SafetensorError as error:
            raise InputError(path, f"corrupt or truncated safetensors file ({error})") from None
    return tensors
