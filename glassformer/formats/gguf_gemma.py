"""Gemma, Gemma 2 and Gemma 3 in GGUF (llama.cpp's `gemma`, `gemma2`, `gemma3`): what their
files say beyond Llama's, for gguf.py (reading) and gguf_export.py (writing).

llama.cpp's converter stores each Gemma norm weight with its 1 already added (1 + w), and
keeps W_Q and W_K as they are (its Gemma RoPE rotates halves, as Glassformer does). Gemma 2's
file holds the two soft-caps and one sliding window; llama.cpp slides on the even layers
(0, 2, ...) and scales scores by (d_model / n_heads)^-½ for its 46-layer model (27B),
by head_dim^-½ otherwise: no query_pre_attn_scalar is stored.

A Gemma 3 file adds query/key norms (attn_q_norm, attn_k_norm, stored as 1 + w too) to Gemma
2's block and may hold the final soft-cap (no attention soft-cap). Where it states a sliding
window, llama.cpp makes every sixth layer global (5, 11, ...) and turns the sliding layers by a
RoPE base fixed at 10000, unscaled; the global layers take rope.freq_base and any rope.scaling.
Its score scale follows Gemma 2's rule, with 62 layers (27B) the wide one. Without a window
every layer is global.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..model.config import ModelConfig
from .gguf_arch import Architecture, Metadata, block_tensors, llama_block, rms_epsilon

NORM_SHIFT = 1.0  # stored = ours + 1 for every norm of a Gemma file
# llama.cpp's defaults where a Gemma 2 file leaves a key out
_DEFAULTS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
             "attention.sliding_window": 4096}
# the depths of Gemma 2 27B and Gemma 3 27B: scores times (d_model / n_heads)^-½
_WIDE_SCALE_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_PATTERN = 6  # layer i is global where i + 1 is a multiple of it
_GEMMA3_LOCAL_THETA = 10000.0  # the sliding layers' RoPE base


def gemma_fields(m: Metadata) -> dict[str, Any]:
    """The ModelConfig fields a Gemma / Gemma 2 / Gemma 3 file adds to Llama's."""
    fields: dict[str, Any] = {"norm_weight_offset": 1.0, "embed_scale": True,
                              "activation": "gelu_tanh"}
    if m.arch == "gemma":
        return fields
    n_layers, d_model = m.count("block_count"), m.count("embedding_length")
    n_heads = m.count("attention.head_count")
    d_head = m.count("attention.key_length", d_model // n_heads)
    scale = d_model // n_heads if n_layers == _WIDE_SCALE_LAYERS[m.arch] else d_head
    fields |= {"norm_placement": "sandwich", "attn_scale": float(scale)}
    if m.arch == "gemma2":
        def value(key: str) -> Any:
            return m.get(key, _DEFAULTS[key])

        window = int(value("attention.sliding_window"))
        return fields | {"attn_softcap": float(value("attn_logit_softcapping")),
                         "final_softcap": float(value("final_logit_softcapping")),
                         "layer_windows": tuple(None if i % 2 else window for i in range(n_layers))}
    final_cap = m.optional("final_logit_softcapping")
    fields |= {"qk_norm": "head", "final_softcap": float(final_cap) if final_cap else None}
    window = m.optional("attention.sliding_window")
    if window:
        fields |= {"rope_local_theta": _GEMMA3_LOCAL_THETA, "layer_windows": tuple(
            None if (i + 1) % _GEMMA3_PATTERN == 0 else int(window) for i in range(n_layers))}
    return fields


def gemma_metadata(arch: str, config: ModelConfig) -> dict[str, Any]:
    """Gemma 2 and 3's own keys for a config (gemma_fields reversed); Gemma has none."""
    if arch == "gemma":
        return {}
    windows = {w for w in config.layer_windows or () if w is not None}
    meta = {"final_logit_softcapping": config.final_softcap,
            "attention.sliding_window": min(windows, default=None)}
    if arch == "gemma2":
        meta["attn_logit_softcapping"] = config.attn_softcap
    return {key: value for key, value in meta.items() if value is not None}  # None: unsayable


def gemma_architecture(name: str) -> Architecture:
    """llama.cpp's `gemma`, `gemma2` or `gemma3`: Llama's block and names, the norms shifted."""
    def fields(m: Metadata, tensors: Mapping[str, Any]) -> dict[str, Any]:
        return llama_block()(m, tensors) | gemma_fields(m)

    return Architecture(name, fields, lambda c: rms_epsilon(c) | gemma_metadata(name, c),
                        lambda c: block_tensors(c, shift=NORM_SHIFT))
