"""Hugging Face model folders (config.json, *.safetensors [+ index], tokenizer.json) -> Glassformer.

Three families, each an explicit key map (`key_map`) between Hugging Face names and ours:
- GPT-2 (`model_type` gpt2): learned positions, LayerNorm, GELU (tanh), fused c_attn. Its
  Conv1D layers store weights as (in, out), so they are transposed.
- Llama (llama, mistral with its sliding window, qwen2 with q/k/v biases): RoPE (rotate-half),
  RMSNorm, SwiGLU. q/k/v_proj are stacked into our fused `qkv`, gate/up_proj into `mlp.up`.
- Qwen3 and OLMo 2 (qwen3, olmo2): Llama with query/key norms, OLMo 2 with output norms in
  place of input norms (huggingface_qk.py).
- T5 (`model_type` t5, v1.0 and v1.1): an encoder-decoder; its config and key map live in
  huggingface_t5.py.
- BERT (bert, a BertForMaskedLM): the encoder with its masked-LM head (huggingface_bert.py).
- Gemma (gemma, gemma2): Llama's block with Gemma's norms, embedding scale, GeGLU, and
  Gemma 2's sandwich norms, soft-caps and sliding layers (huggingface_gemma.py).
- GPT-NeoX / Pythia (gpt_neox): parallel blocks, partial rotary, a per-head fused
  query_key_value (huggingface_neox.py).
- Phi-3 (phi3): Llama's block with fused qkv_proj and gate_up_proj, partial rotary
  (huggingface_phi3.py).
Every key and shape is checked, then the weights load with `load_state_dict(strict=True)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..errors import InputError
from ..model.config import ModelConfig
from ..model.encoder_decoder import EncoderDecoder
from ..model.transformer import Transformer
from .chat_tokenizer import ChatTokenizer
from .empty_model import empty_model
from .files import read_json_object
from .huggingface_bert import POOLER_KEY, TIED_COPIES, bert_config, bert_keys
from .huggingface_gemma import GEMMA_TYPES, gemma_config, gemma_keys
from .huggingface_neox import NEOX_HEAD, neox_config, neox_keys
from .huggingface_phi3 import phi3_config, phi3_keys
from .huggingface_qk import QK_TYPES, family_fields, qwen_window, with_defaults
from .huggingface_t5 import t5_config, t5_keys
from .tensor_map import Entry
from .validate import check_model, check_tensor

GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                    "relu": "relu"}
LLAMA_TYPES = ("llama", "mistral", "qwen2")
# Buffers some transformers versions save, carrying no weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq",
                     ".attention.bias", ".attention.masked_bias")
# Copies of T5's shared token table that some files also store under each stack's name.
_T5_TIED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")



def config_from_hf(hf: dict[str, Any], pooler: bool = False) -> ModelConfig:
    """A ModelConfig equal to a Hugging Face config.json (as a dict); `pooler`: the weights
    hold BERT's pooler."""
    kind = hf.get("model_type")
    try:
        if kind == "gpt2":
            return _gpt2_config(hf)
        if kind in LLAMA_TYPES:
            return _llama_config(hf)
        if kind in QK_TYPES:
            hf = with_defaults(hf)
            return _llama_config(hf).replace(**family_fields(hf))
        if kind == "t5":
            return t5_config(hf)
        if kind == "bert":
            return bert_config(hf, pooler)
        if kind in GEMMA_TYPES:
            return gemma_config(hf, rope_fields(hf))
        if kind == "gpt_neox":
            return neox_config(hf)
        if kind == "phi3":
            return phi3_config(hf)
    except KeyError as error:
        raise InputError(None, f"config.json lacks {error.args[0]!r} for model_type {kind!r}") from None
    except InputError:
        raise
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as error:  # a value of another type
        raise InputError(None, f"config.json: a value this model_type ({kind!r}) cannot take "
                         f"({type(error).__name__}: {error})") from None
    raise InputError(None, f"unsupported model_type {kind!r} (supported: gpt2, {', '.join(LLAMA_TYPES)}, "
                     f"{', '.join(QK_TYPES)}, t5, bert, {', '.join(GEMMA_TYPES)}, gpt_neox, phi3)")


def _gpt2_config(hf: dict[str, Any]) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise InputError(None, f"unsupported GPT-2 activation_function {act!r}")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if hf.get(flag):
            raise InputError(None, f"unsupported GPT-2 option {flag}=true")
    if hf.get("scale_attn_weights") is False:
        raise InputError(None, "unsupported GPT-2 option scale_attn_weights=false")
    return ModelConfig(
        vocab_size=hf["vocab_size"], context_length=hf["n_positions"], d_model=hf["n_embd"],
        n_layers=hf["n_layer"], n_heads=hf["n_head"], d_ff=hf.get("n_inner"),
        position="learned", norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=GPT2_ACTIVATIONS[act], tie_embeddings=hf.get("tie_word_embeddings", True),
    )


# A Hugging Face rope_type -> the ModelConfig's rope_scaling
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn",
              "longrope": "longrope"}


def _rope_scaling(rope_type: str, rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Hugging Face rope_parameters (rope_scaling) entry; every key
    that changes the angles is read as transformers reads it (modeling_rope_utils), or refused:
    - linear: factor;
    - llama3: factor, both band factors, the original context;
    - yarn: factor (by default the context over the original), beta_fast and beta_slow (by
      default 32 and 1), truncate, attention_factor (by default derived from the factor;
      mscale with mscale_all_dim, DeepSeek's derivation, is refused);
    - longrope: short_factor and long_factor, the original context, factor (by default the
      context over the original: it derives the attention factor), attention_factor.
    The original context is config.json's top-level original_max_position_embeddings where it
    has one (Phi-3's), else the entry's, else max_position_embeddings."""
    if rope_type == "default":
        return {}
    original = int(hf.get("original_max_position_embeddings")
                   or rope.get("original_max_position_embeddings") or hf["max_position_embeddings"])
    factor = rope["factor"] if rope_type in ("linear", "llama3") else rope.get("factor")
    if factor is None:
        factor = hf["max_position_embeddings"] / original
    fields = {"rope_scaling": ROPE_TYPES[rope_type], "rope_factor": float(factor)}
    if rope_type in ("llama3", "yarn", "longrope"):
        fields["rope_original_context"] = original
    if rope_type == "llama3":
        fields |= {"rope_low_freq_factor": float(rope["low_freq_factor"]),
                   "rope_high_freq_factor": float(rope["high_freq_factor"])}
    if rope_type in ("yarn", "longrope") and rope.get("attention_factor") is not None:
        fields["rope_attention_factor"] = float(rope["attention_factor"])
    if rope_type == "yarn":
        if "rope_attention_factor" not in fields and rope.get("mscale") and rope.get("mscale_all_dim"):
            raise InputError("rope_scaling", "unsupported yarn mscale / mscale_all_dim (the "
                             "attention factor they derive is not computed; give attention_factor)")
        fields |= {"rope_beta_fast": float(rope.get("beta_fast") or 32.0),
                   "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
                   "rope_truncate": bool(rope.get("truncate", True))}
    if rope_type == "longrope":
        fields |= {"rope_short_factors": tuple(float(f) for f in rope["short_factor"]),
                   "rope_long_factors": tuple(float(f) for f in rope["long_factor"])}
    return fields


def rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig's RoPE fields (rope_theta and any scaling) of a config.json."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise InputError(None, f"unsupported rope type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    return {"rope_theta": float(theta), **_rope_scaling(rope_type, rope, hf)}


def _llama_config(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise InputError(None, f"unsupported hidden_act {hf['hidden_act']!r} (expected silu)")
    qwen = hf["model_type"] == "qwen2"
    # Qwen names a window but uses it only with use_sliding_window, on some layers
    window = qwen_window(hf) if hf["model_type"] in ("qwen2", "qwen3") else hf.get("sliding_window")
    n_heads = hf["num_attention_heads"]
    d_head = hf.get("head_dim") or hf["hidden_size"] // n_heads
    return ModelConfig(
        vocab_size=hf["vocab_size"], context_length=hf["max_position_embeddings"],
        d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        d_head=d_head if d_head * n_heads != hf["hidden_size"] else None,
        d_ff=hf["intermediate_size"], position="rope", **rope_fields(hf),
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), activation="silu", gated=True,
        attn_bias=qwen or bool(hf.get("attention_bias", False)),
        attn_out_bias=not qwen and bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), sliding_window=window,
    )


def key_map(config: ModelConfig, model_type: str) -> list[Entry]:
    """Every Hugging Face tensor of the family with where it goes in Glassformer."""
    if model_type == "gpt2":
        return _gpt2_keys(config)
    if model_type == "t5":
        return [Entry(hf, ours, rows) for hf, ours, rows in t5_keys(config)]
    if model_type == "bert":
        return bert_keys(config)
    if model_type in GEMMA_TYPES:
        return gemma_keys(config)
    if model_type == "gpt_neox":
        return neox_keys(config)
    if model_type == "phi3":
        return phi3_keys(config)
    return _llama_keys(config)  # llama, mistral, qwen2, qwen3, olmo2: the config says which parts


def _gpt2_keys(c: ModelConfig) -> list[Entry]:
    p = "transformer."
    entries = [Entry(p + "wte.weight", "embed.tokens.weight"),
               Entry(p + "wpe.weight", "embed.positions.weight")]
    for i in range(c.n_layers):
        h, b = f"{p}h.{i}.", f"blocks.{i}."
        for ours, theirs, conv in (("norm1", "ln_1", False), ("attn.qkv", "attn.c_attn", True),
                                   ("attn.out", "attn.c_proj", True), ("norm2", "ln_2", False),
                                   ("mlp.up", "mlp.c_fc", True), ("mlp.down", "mlp.c_proj", True)):
            entries.append(Entry(f"{h}{theirs}.weight", f"{b}{ours}.weight", transpose=conv))
            entries.append(Entry(f"{h}{theirs}.bias", f"{b}{ours}.bias"))
    entries += [Entry(p + "ln_f.weight", "final_norm.weight"), Entry(p + "ln_f.bias", "final_norm.bias")]
    if not c.tie_embeddings:
        entries.append(Entry("lm_head.weight", "lm_head.weight"))
    return entries


def _llama_keys(c: ModelConfig) -> list[Entry]:
    H, KV, ff = c.n_heads * c.head_dim, c.kv_heads * c.head_dim, c.ff_dim
    entries = [Entry("model.embed_tokens.weight", "embed.tokens.weight"),
               Entry("model.norm.weight", "final_norm.weight")]
    for i in range(c.n_layers):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        if c.norm_placement == "out":  # OLMo 2: each sublayer's output normed
            entries += [Entry(h + "post_attention_layernorm.weight", b + "attn_out_norm.weight"),
                        Entry(h + "post_feedforward_layernorm.weight", b + "mlp_out_norm.weight")]
        else:
            entries += [Entry(h + "input_layernorm.weight", b + "norm1.weight"),
                        Entry(h + "post_attention_layernorm.weight", b + "norm2.weight")]
        if c.qk_norm != "none":
            entries += [Entry(f"{h}self_attn.{n}_norm.weight", f"{b}attn.{n}_norm.weight") for n in "qk"]
        kinds = [("weight", True), ("bias", c.attn_bias)]
        for name, rows in (("q_proj", (0, H)), ("k_proj", (H, H + KV)), ("v_proj", (H + KV, H + 2 * KV))):
            entries += [Entry(f"{h}self_attn.{name}.{k}", f"{b}attn.qkv.{k}", rows) for k, on in kinds if on]
        entries += [Entry(f"{h}self_attn.o_proj.{k}", f"{b}attn.out.{k}")
                    for k, on in (("weight", True), ("bias", c.attn_out_bias)) if on]
        for name, ours, rows in (("gate_proj", "up", (0, ff)), ("up_proj", "up", (ff, 2 * ff)),
                                 ("down_proj", "down", None)):
            entries += [Entry(f"{h}mlp.{name}.{k}", f"{b}mlp.{ours}.{k}", rows)
                        for k, on in (("weight", True), ("bias", c.mlp_bias)) if on]
    if not c.tie_embeddings:
        entries.append(Entry("lm_head.weight", "lm_head.weight"))
    return entries


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
    return hf, config_from_hf(hf)


def load_hf_model(folder: str | Path, dtype: torch.dtype = torch.float32,
                  configs: tuple[dict, ModelConfig] | None = None) -> Transformer | EncoderDecoder:
    """The model of a Hugging Face folder alone (eval mode, on CPU), for folders without a
    tokenizer; `configs` is read_config's answer where it was read already."""
    folder = Path(folder)
    hf, config = configs or read_config(folder)
    tensors = read_safetensors(folder)
    if POOLER_KEY in tensors:  # BERT's pooler, where the file holds one
        config = config_from_hf(hf, pooler=True)
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
    entries = key_map(config, model_type)
    prefix = "transformer." if model_type == "gpt2" else ""
    if prefix and not any(k.startswith(prefix) for k in tensors):  # original GPT-2 files omit it
        tensors = {prefix + k if k != "lm_head.weight" else k: v for k, v in tensors.items()}
    wanted = {e.hf for e in entries}
    missing = sorted(wanted - set(tensors))
    if missing:
        raise InputError(None, f"missing tensor {missing[0]} ({len(missing)} missing in all)")
    tied = {"lm_head.weight"} if config.tie_embeddings else set()
    if model_type == "t5":
        tied |= set(_T5_TIED_COPIES)
    if model_type == "bert":  # copies of tied tensors a file may hold beside the originals
        tied = ({TIED_COPIES[0]} if config.tie_embeddings else set()) | {TIED_COPIES[1]}
    if model_type == "gpt_neox" and config.tie_embeddings:  # a copy of the tied head
        tied = {NEOX_HEAD}
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
