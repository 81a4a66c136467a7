"""Llama, Mistral and Qwen2 (`model_type` llama, mistral, qwen2) <-> Glassformer: the config
and the key map, both ways.

RoPE (rotate-half), RMSNorm, SwiGLU; Mistral adds a sliding window, Qwen2 biases on q, k, v.
q/k/v_proj are stacked into our fused `qkv`, gate/up_proj into `mlp.up`. Qwen3 and OLMo 2
(huggingface_qk.py) read the same fields and tensors, and add their norms.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..model.config import ModelConfig
from .huggingface_qk import qwen_window
from .huggingface_rope import rope_fields, rope_scaling_entry
from .refusals import plain_decoder, require
from .tensor_map import Entry


def head_dim(hf: dict[str, Any]) -> int:
    """A Llama-style config.json's head size: head_dim, else hidden_size / heads."""
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def llama_sizes(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig's sizes of a Llama-style config.json (Llama, Mistral, Qwen, Phi-3)."""
    n_heads, d_head = hf["num_attention_heads"], head_dim(hf)
    return dict(
        vocab_size=hf["vocab_size"], context_length=hf["max_position_embeddings"],
        d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        d_head=d_head if d_head * n_heads != hf["hidden_size"] else None,
        d_ff=hf["intermediate_size"])


def llama_config(hf: dict[str, Any]) -> ModelConfig:
    """A ModelConfig equal to a Llama, Mistral or Qwen2 config.json (as a dict)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise InputError(None, f"unsupported hidden_act {hf['hidden_act']!r} (expected silu)")
    qwen = hf["model_type"] == "qwen2"
    # Qwen names a window but uses it only with use_sliding_window, on some layers
    window = qwen_window(hf) if hf["model_type"] in ("qwen2", "qwen3") else hf.get("sliding_window")
    return ModelConfig(
        **llama_sizes(hf), position="rope", **rope_fields(hf),
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), activation="silu", gated=True,
        attn_bias=qwen or bool(hf.get("attention_bias", False)),
        attn_out_bias=not qwen and bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), sliding_window=window,
    )


def llama_keys(c: ModelConfig) -> list[Entry]:
    """Every tensor of a Llama-block model (llama, mistral, qwen2, qwen3, olmo2: the config says
    which norms and biases it has; a LayerNorm's bias beside its weight) with where it goes in
    Glassformer."""
    H, KV, ff = c.n_heads * c.head_dim, c.kv_heads * c.head_dim, c.ff_dim
    norm_kinds = ("weight", "bias") if c.norm == "layernorm" and c.norm_bias else ("weight",)

    def norms(*pairs: tuple[str, str]) -> list[Entry]:
        return [Entry(f"{theirs}.{k}", f"{ours}.{k}") for theirs, ours in pairs for k in norm_kinds]

    entries = [Entry("model.embed_tokens.weight", "embed.tokens.weight"),
               *norms(("model.norm", "final_norm"))]
    for i in range(c.n_layers):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        if c.norm_placement == "out":  # OLMo 2: each sublayer's output normed
            entries += norms((h + "post_attention_layernorm", b + "attn_out_norm"),
                             (h + "post_feedforward_layernorm", b + "mlp_out_norm"))
        else:
            entries += norms((h + "input_layernorm", b + "norm1"),
                             (h + "post_attention_layernorm", b + "norm2"))
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


def llama_hf_config(config: ModelConfig) -> dict[str, Any]:
    """The config.json fields of a Llama-like model (refused by field where it is not one)."""
    require(config, "Llama", position="rope", norm="rmsnorm", activation="silu", gated=True)
    if config.rope_scaling not in ("none", "linear", "llama3", "yarn"):
        raise InputError("rope_scaling", f"{config.rope_scaling!r} cannot be exported as Llama "
                         "(none, linear, llama3, yarn)")
    return {"vocab_size": config.vocab_size, "max_position_embeddings": config.context_length,
            "hidden_size": config.d_model, "intermediate_size": config.ff_dim,
            "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
            "rms_norm_eps": config.norm_eps, "hidden_act": "silu", "rope_theta": config.rope_theta,
            "rope_scaling": rope_scaling_entry(config),
            "tie_word_embeddings": config.tie_embeddings, "attention_bias": config.attn_out_bias,
            "mlp_bias": config.mlp_bias, "attention_dropout": 0.0}


def _llama_block(config: ModelConfig, kind: str, architecture: str) -> dict[str, Any]:
    plain_decoder(config)
    require(config, "Llama", position="rope", norm="rmsnorm", activation="silu", gated=True,
            parallel_block=False)
    if config.attn_out_bias and not config.attn_bias:
        raise InputError("attn_out_bias", "a bias on W_O alone cannot be exported")
    return {"model_type": kind, "architectures": [architecture], **llama_hf_config(config)}


def llama_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json of a LlamaForCausalLM equal to `config` (refused field by field)."""
    out = _llama_block(config, "llama", "LlamaForCausalLM")
    require(config, "Llama", sliding_window=None)
    return out


def mistral_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json of a MistralForCausalLM: Llama's with a sliding window."""
    out = _llama_block(config, "mistral", "MistralForCausalLM")
    require(config, "Mistral", attn_bias=False)
    return out | {"sliding_window": config.sliding_window}


def qwen2_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json of a Qwen2ForCausalLM: Llama's with biases on q, k, v only."""
    out = _llama_block(config, "qwen2", "Qwen2ForCausalLM")
    require(config, "Qwen2", mlp_bias=False)
    return out | {"use_sliding_window": config.sliding_window is not None,
                  "sliding_window": config.sliding_window, "max_window_layers": 0}
