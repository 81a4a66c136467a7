"""Gemma and Gemma 2 in GGUF (llama.cpp's `gemma`, `gemma2`): what their files say beyond
Llama's, for gguf.py (reading) and gguf_export.py (writing).

llama.cpp's converter stores each Gemma norm weight with its 1 already added (1 + w), and
keeps W_Q and W_K as they are (its Gemma RoPE rotates halves, as Glassformer does). Gemma 2's
file holds the two soft-caps and one sliding window; llama.cpp slides on the even layers
(0, 2, ...) and scales scores by (d_model / n_heads)^-½ for its 46-layer model (27B),
by head_dim^-½ otherwise: no query_pre_attn_scalar is stored.
"""

from __future__ import annotations

from typing import Any

GEMMA_ARCHITECTURES = ("gemma", "gemma2")
NORM_SHIFT = 1.0  # stored = ours + 1 for every norm of a Gemma file
# llama.cpp's defaults where a Gemma 2 file leaves a key out
_DEFAULTS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
             "attention.sliding_window": 4096}
_WIDE_SCALE_LAYERS = 46  # Gemma 2 27B: scores times (d_model / n_heads)^-½


def gemma_fields(arch: str, meta: dict[str, Any], n_layers: int, d_model: int, n_heads: int,
                 d_head: int) -> dict[str, Any]:
    """The ModelConfig fields a Gemma / Gemma 2 file adds to Llama's."""
    fields: dict[str, Any] = {"norm_weight_offset": 1.0, "embed_scale": True,
                              "activation": "gelu_tanh"}
    if arch == "gemma2":
        def value(key: str) -> Any:
            return meta.get(f"gemma2.{key}", _DEFAULTS[key])

        window = int(value("attention.sliding_window"))
        scale = d_model // n_heads if n_layers == _WIDE_SCALE_LAYERS else d_head
        fields |= {"norm_placement": "sandwich", "attn_scale": float(scale),
                   "attn_softcap": float(value("attn_logit_softcapping")),
                   "final_softcap": float(value("final_logit_softcapping")),
                   "layer_windows": tuple(None if i % 2 else window for i in range(n_layers))}
    return fields


def gemma_metadata(arch: str, config) -> dict[str, Any]:
    """Gemma 2's own keys for a config (gemma_fields reversed); Gemma has none."""
    if arch != "gemma2":
        return {}
    windows = {w for w in config.layer_windows or () if w is not None}
    meta = {"gemma2.attn_logit_softcapping": config.attn_softcap,
            "gemma2.final_logit_softcapping": config.final_softcap,
            "gemma2.attention.sliding_window": min(windows, default=None)}
    return {key: value for key, value in meta.items() if value is not None}  # None: unsayable
