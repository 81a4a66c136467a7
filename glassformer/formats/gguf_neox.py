"""GGUF's `gptneox` and `phi3` architectures, as llama.cpp names them: the ModelConfig fields
their `<arch>.*` metadata gives, and the metadata export writes.

Both rotate halves of the first rope.dimension_count dimensions of each head (llama.cpp's
NEOX RoPE, Glassformer's), so no row is permuted, unlike `llama`. llama.cpp's converter stores
NeoX's query_key_value already cut into q, k, v (our `attn.qkv` order), with LayerNorm weights
and biases; use_parallel_residual says how the block adds. A Phi-3 file keeps the fused
attn_qkv and ffn_up (gate rows, then up rows) as Hugging Face has them; attention.sliding_window
0 means none; its LongRoPE factor tensors are read by gguf_rope.py.
The feed-forward of a gptneox file is GELU: read as the exact one transformers computes for
Pythia (llama.cpp's is its tanh approximation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..model.config import ModelConfig
from .gguf_arch import Architecture, Metadata, block_tensors


def _neox_fields(m: Metadata, tensors: Mapping[str, Any]) -> dict[str, Any]:
    return {"norm": "layernorm", "norm_eps": float(m.get("attention.layer_norm_epsilon")),
            "parallel_block": bool(m.get("use_parallel_residual", True)),
            "activation": "gelu", "gated": False, "mlp_bias": True,
            "attn_bias": "blk.0.attn_qkv.bias" in tensors,
            "attn_out_bias": "blk.0.attn_output.bias" in tensors}


def _neox_metadata(c: ModelConfig) -> dict[str, Any]:
    return {"attention.layer_norm_epsilon": c.norm_eps, "use_parallel_residual": c.parallel_block}


def _phi3_fields(m: Metadata, tensors: Mapping[str, Any]) -> dict[str, Any]:
    window = m.get("attention.sliding_window", 0)
    return {"norm": "rmsnorm", "norm_eps": float(m.get("attention.layer_norm_rms_epsilon")),
            "activation": "silu", "gated": True, "attn_bias": False, "attn_out_bias": False,
            "mlp_bias": False, "sliding_window": window or None}


def _phi3_metadata(c: ModelConfig) -> dict[str, Any]:
    return {"attention.layer_norm_rms_epsilon": c.norm_eps,
            "attention.sliding_window": c.sliding_window or 0}


def _fused(c: ModelConfig):
    return block_tensors(c, fused=True)


GPTNEOX = Architecture("gptneox", _neox_fields, _neox_metadata, _fused, partial_rotary=True)
# Export writes Llama's block as phi3 where it turns part of each head, slides a window (which
# no llama file can say) or runs LongRoPE.
PHI3 = Architecture("phi3", _phi3_fields, _phi3_metadata, _fused, partial_rotary=True,
                    claims=lambda c: c.position == "rope" and (
                        c.rotary_dim is not None or c.sliding_window is not None
                        or c.rope_scaling == "longrope"))
