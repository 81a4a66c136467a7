"""Qwen3 and OLMo 2 (`model_type` qwen3, olmo2) <-> Glassformer: what sets them apart from Llama.

Both are Llama blocks (RoPE, RMSNorm, SwiGLU; q/k/v_proj stacked into our fused `qkv`) with
an RMSNorm on the queries and keys after the projection, before RoPE (`qk_norm`):
- Qwen3: over each head's d_head (`qk_norm="head"`); head_dim is its own field; a sliding
  window on the layers from max_window_layers on, when use_sliding_window is set.
- OLMo 2: over the whole projection, heads side by side (`qk_norm="all"`), and no input norms:
  each sublayer's output is normed before the residual add (`norm_placement="out"`, the
  tensors post_attention_layernorm and post_feedforward_layernorm).
huggingface_llama.py reads the Llama fields and the key map; this module adds the rest
(families.py puts the two together).
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..model.config import ModelConfig
from .refusals import require

# Values the config classes take when config.json leaves a field out.
DEFAULTS = {"qwen3": {"head_dim": 128, "rms_norm_eps": 1e-6}, "olmo2": {"rms_norm_eps": 1e-5}}
# What each family's blocks compute, as ModelConfig fields.
FAMILY_FIELDS = {"qwen3": {"qk_norm": "head", "norm_placement": "pre"},
                 "olmo2": {"qk_norm": "all", "norm_placement": "out"}}


def with_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json with the family's defaults where it leaves a field out."""
    return DEFAULTS[hf["model_type"]] | hf


def family_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields a qwen3 / olmo2 config.json adds to the Llama ones; a setting
    that changes the math and is not computed is refused by name."""
    if hf["model_type"] == "olmo2" and hf.get("clip_qkv") is not None:
        raise InputError("clip_qkv", f"OLMo's clipping of q, k, v ({hf['clip_qkv']}) is not computed")
    return FAMILY_FIELDS[hf["model_type"]]


def qwen_window(hf: dict[str, Any]) -> int | None:
    """The sliding window of a Qwen2 / Qwen3 config.json: its layers are listed in layer_types,
    or else slide from max_window_layers on when use_sliding_window is set. One window for
    every layer or none is computed; a model that mixes the two is refused."""
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
    kinds = hf.get("layer_types")
    if kinds is None:
        first = hf.get("max_window_layers", 28)
        kinds = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(n)]
    sliding = {kind == "sliding_attention" for kind in kinds}
    if sliding == {True, False}:
        field = "layer_types" if "layer_types" in hf else "max_window_layers"
        raise InputError(field, "a sliding window on some layers only is not computed")
    if sliding == {True} and window is None:
        raise InputError("sliding_window", "layer_types slide but no window is set")
    return window if sliding == {True} else None


def qk_hf_config(config: ModelConfig, llama: dict[str, Any], kind: str) -> dict[str, Any]:
    """The config.json of a `kind` model (qwen3 or olmo2) from the Llama config.json `llama` of
    the same model, refused by field where it is not one."""
    require(config, {"qwen3": "Qwen3", "olmo2": "OLMo 2"}[kind], **FAMILY_FIELDS[kind])
    if config.attn_bias != config.attn_out_bias:
        raise InputError("attn_bias", f"{kind} has biases on all of q, k, v, o or none")
    if config.mlp_bias:
        raise InputError("mlp_bias", f"{kind} has no feed-forward biases")
    out = {k: v for k, v in llama.items() if k not in ("model_type", "architectures", "mlp_bias")}
    if kind == "olmo2":
        if config.sliding_window is not None:
            raise InputError("sliding_window", "OLMo 2 has no sliding window")
        return {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], **out}
    window = config.sliding_window
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **out,
            "use_sliding_window": window is not None, "sliding_window": window,
            "max_window_layers": 0}
