"""GGUF's `gptneox` and `phi3` architectures, as llama.cpp names them: the ModelConfig fields
their `<arch>.*` metadata gives, their tensor names, and the metadata export writes.

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

from collections.abc import Callable
from typing import Any

from ..model.config import ModelConfig

NEOX_ARCHITECTURES = ("gptneox", "phi3")
# GGUF tensor name -> (our parameter, its block of rows or None)
Names = dict[str, tuple[str, tuple[int, int] | None]]


def neox_fields(arch: str, get: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields an `arch` file's metadata (`get(key, default)`) and tensors set
    beyond those every architecture shares."""
    if arch == "gptneox":
        return {"norm": "layernorm", "norm_eps": float(get("attention.layer_norm_epsilon")),
                "parallel_block": bool(get("use_parallel_residual", True)),
                "activation": "gelu", "gated": False, "mlp_bias": True,
                "attn_bias": "blk.0.attn_qkv.bias" in tensors,
                "attn_out_bias": "blk.0.attn_output.bias" in tensors}
    window = get("attention.sliding_window", 0)
    return {"norm": "rmsnorm", "norm_eps": float(get("attention.layer_norm_rms_epsilon")),
            "activation": "silu", "gated": True, "attn_bias": False, "attn_out_bias": False,
            "mlp_bias": False, "sliding_window": window or None}


def family_names(arch: str, c: ModelConfig) -> Names:
    """Every tensor an `arch` file of config `c` holds, with where it goes."""
    kinds = ("weight", "bias") if arch == "gptneox" else ("weight",)
    names: Names = {"token_embd.weight": ("embed.tokens.weight", None)}
    names |= {f"output_norm.{k}": (f"final_norm.{k}", None) for k in kinds}
    if not c.tie_embeddings:
        names["output.weight"] = ("lm_head.weight", None)
    for i in range(c.n_layers):
        b = f"blocks.{i}."
        for theirs, ours, bias in (("attn_norm", "norm1", True), ("ffn_norm", "norm2", True),
                                   ("attn_qkv", "attn.qkv", c.attn_bias),
                                   ("attn_output", "attn.out", c.attn_out_bias),
                                   ("ffn_up", "mlp.up", c.mlp_bias),
                                   ("ffn_down", "mlp.down", c.mlp_bias)):
            names |= {f"blk.{i}.{theirs}.{k}": (f"{b}{ours}.{k}", None) for k in kinds
                      if k == "weight" or bias}
    return names


def family_of(c: ModelConfig) -> str:
    """The GGUF architecture export writes for `c`: for RoPE, gptneox with LayerNorm or a
    parallel block, phi3 with a partial rotary, a window or LongRoPE; llama otherwise (what it cannot
    say is refused by name)."""
    if c.position != "rope":
        return "llama"
    if c.norm == "layernorm" or c.parallel_block:
        return "gptneox"
    if c.rotary_dim is not None or c.sliding_window is not None or c.rope_scaling == "longrope":
        return "phi3"
    return "llama"


def family_metadata(arch: str, c: ModelConfig) -> dict[str, Any]:
    """The `<arch>.*` values beyond those every architecture shares."""
    if arch == "gptneox":
        return {"gptneox.attention.layer_norm_epsilon": c.norm_eps,
                "gptneox.use_parallel_residual": c.parallel_block}
    return {"phi3.attention.layer_norm_rms_epsilon": c.norm_eps,
            "phi3.attention.sliding_window": c.sliding_window or 0}
