"""RoPE as a Hugging Face config.json states it (rope_theta, rope_parameters / rope_scaling) ->
the ModelConfig's RoPE fields; export.py writes them back."""

from __future__ import annotations

from typing import Any

from ..errors import InputError

# A Hugging Face rope_type -> the ModelConfig's rope_scaling
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}


def _rope_scaling(rope_type: str, rope: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Hugging Face rope_parameters (rope_scaling) entry; every key
    that changes the angles is read (llama3: factor, both band factors, the original context)."""
    if rope_type == "default":
        return {}
    fields = {"rope_scaling": ROPE_TYPES[rope_type], "rope_factor": float(rope["factor"])}
    if rope_type == "llama3":
        fields |= {"rope_low_freq_factor": float(rope["low_freq_factor"]),
                   "rope_high_freq_factor": float(rope["high_freq_factor"]),
                   "rope_original_context": int(rope["original_max_position_embeddings"])}
    return fields


def rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig's RoPE fields (rope_theta and any scaling) of a config.json."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise InputError(None, f"unsupported rope type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    return {"rope_theta": float(theta), **_rope_scaling(rope_type, rope)}
