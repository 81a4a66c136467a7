"""RoPE as a Hugging Face config.json states it (rope_theta, rope_parameters / rope_scaling) ->
the ModelConfig's RoPE fields (rope_fields), and back (rope_scaling_entry, for export)."""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..model.config import ModelConfig

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


def rope_scaling_entry(config: ModelConfig) -> dict | None:
    """The Hugging Face rope_scaling entry of a config (`_rope_scaling` reversed)."""
    if config.rope_scaling == "none":
        return None
    entry = {"rope_type": config.rope_scaling, "factor": config.rope_factor}
    if config.rope_scaling in ("llama3", "yarn", "longrope"):
        entry["original_max_position_embeddings"] = config.original_context
    if config.rope_scaling == "llama3":
        entry |= {"low_freq_factor": config.rope_low_freq_factor,
                  "high_freq_factor": config.rope_high_freq_factor}
    if config.rope_scaling == "yarn":
        entry |= {"beta_fast": config.rope_beta_fast, "beta_slow": config.rope_beta_slow,
                  "truncate": config.rope_truncate}
    if config.rope_scaling == "longrope":
        entry |= {"short_factor": list(config.rope_short_factors),
                  "long_factor": list(config.rope_long_factors)}
    if config.rope_attention_factor is not None:
        entry["attention_factor"] = config.rope_attention_factor
    return entry
