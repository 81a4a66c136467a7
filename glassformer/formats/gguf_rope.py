"""RoPE scaling in GGUF files, both ways, under the keys and tensor names llama.cpp uses.

- linear: `<arch>.rope.scaling.type` linear and `.factor`.
- yarn: type yarn, `.factor`, `.original_context_length` (by default the file's context
  length, as llama.cpp takes it), `.yarn_beta_fast` and `.yarn_beta_slow` (by default 32 and
  1), and `.yarn_attn_factor` where the attention factor is stated (Hugging Face's
  attention_factor, as llama.cpp's converter writes it). llama.cpp always rounds the band's
  edges to whole dimensions, so rope_truncate=False cannot be written; DeepSeek's
  `.yarn_log_multiplier` and an extrapolation mix other than 1 (`.yarn_ext_factor`) are
  refused when read.
- longrope (Phi-3): the tensors rope_factors_short and rope_factors_long (one factor per
  turning pair), `.original_context_length` and `.attn_factor`, the factor cos and sin are
  scaled by (llama.cpp's converter writes the derived one; so does export). Files from that
  converter name no type: the factor tensors say it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf.quants import dequantize

from ..errors import InputError
from ..model.config import ModelConfig
from ..model.layers.positions import rope_inverse_frequencies
from .gguf_file import GGUFFile

# LongRoPE's factor tensors -> the ModelConfig field each one gives
FACTOR_TENSORS = {"rope_factors_short.weight": "rope_short_factors",
                  "rope_factors_long.weight": "rope_long_factors"}


def read_factors(file: GGUFFile) -> dict[str, tuple[float, ...]]:
    """The values of the LongRoPE factor tensors a file holds (none: empty)."""
    return {name: tuple(float(x) for x in dequantize(file.raw(name), file.tensors[name].qtype).reshape(-1))
            for name in FACTOR_TENSORS if name in file.tensors}


def rope_scaling_fields(arch: str, meta: dict[str, Any], context_length: int,
                        factors: dict[str, tuple[float, ...]]) -> dict[str, Any]:
    """The ModelConfig's RoPE scaling fields of an `arch` file's metadata and factor tensors."""

    def number(key: str, default: float | None = None) -> float:
        value = meta.get(f"{arch}.rope.scaling.{key}", default)
        if value is None:
            raise InputError(None, f"GGUF metadata lacks {arch}.rope.scaling.{key}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e30:
            raise InputError(None, f"GGUF metadata {arch}.rope.scaling.{key} = {value!r}: "
                             "expected a positive number")
        return float(value)

    scaling = meta.get(f"{arch}.rope.scaling.type", "longrope" if factors else "none")
    if scaling not in ("none", "linear", "yarn", "longrope"):
        raise InputError(None, f"unsupported GGUF RoPE scaling {scaling!r}")
    if (scaling == "longrope") != bool(factors):
        raise InputError(None, f"GGUF RoPE scaling {scaling!r} with {sorted(factors) or 'no'} "
                         "factor tensors (longrope needs rope_factors_short and rope_factors_long)")
    if scaling != "longrope" and number("attn_factor", 1.0) != 1.0:
        raise InputError(None, f"unsupported GGUF {arch}.rope.scaling.attn_factor with {scaling!r}")
    if scaling == "none":
        return {}
    fields: dict[str, Any] = {"rope_scaling": scaling}
    if scaling in ("linear", "yarn"):
        fields["rope_factor"] = number("factor")
    if scaling == "yarn":
        if meta.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0) != 0.0:
            raise InputError(None, f"unsupported GGUF {arch}.rope.scaling.yarn_log_multiplier")
        if meta.get(f"{arch}.rope.scaling.yarn_ext_factor", 1.0) not in (1.0, -1.0):  # -1: llama.cpp's 1
            raise InputError(None, f"unsupported GGUF {arch}.rope.scaling.yarn_ext_factor")
        fields |= {"rope_original_context": int(number("original_context_length", context_length)),
                   "rope_beta_fast": number("yarn_beta_fast", 32.0),
                   "rope_beta_slow": number("yarn_beta_slow", 1.0)}
        if f"{arch}.rope.scaling.yarn_attn_factor" in meta:
            fields["rope_attention_factor"] = number("yarn_attn_factor")
    if scaling == "longrope":
        original = int(number("original_context_length"))
        fields |= {"rope_original_context": original,
                   "rope_factor": number("factor", max(context_length / original, 1.0)),
                   "rope_attention_factor": number("attn_factor", 1.0),
                   **{field: factors[name] for name, field in FACTOR_TENSORS.items()}}
    return fields


def rope_scaling_metadata(arch: str, config: ModelConfig) -> dict[str, Any]:
    """The `<arch>.rope.scaling.*` values of `config` (floats: float32 where written)."""
    if config.rope_scaling == "none":
        return {}
    key = f"{arch}.rope.scaling."
    meta = {key + "type": config.rope_scaling, key + "factor": config.rope_factor}
    if config.rope_scaling in ("yarn", "longrope"):
        meta[key + "original_context_length"] = config.original_context
    if config.rope_scaling == "yarn":
        meta |= {key + "yarn_beta_fast": config.rope_beta_fast,
                 key + "yarn_beta_slow": config.rope_beta_slow}
        if config.rope_attention_factor is not None:
            meta[key + "yarn_attn_factor"] = config.rope_attention_factor
    if config.rope_scaling == "longrope":
        meta[key + "attn_factor"] = attention_factor(config)
    return meta


def factor_tensors(config: ModelConfig) -> dict[str, np.ndarray]:
    """LongRoPE's factor tensors of `config`, float32 (rotated/2,) each; none for the others."""
    if config.rope_scaling != "longrope":
        return {}
    return {name: np.array(getattr(config, field), dtype=np.float32)
            for name, field in FACTOR_TENSORS.items()}


def attention_factor(config: ModelConfig) -> float:
    """The factor cos and sin are scaled by, stated or derived (layers/positions.py)."""
    return rope_inverse_frequencies(config)[1]
