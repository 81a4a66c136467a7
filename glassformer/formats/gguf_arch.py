"""A GGUF architecture (llama.cpp's `general.architecture`): what a family's files say beyond
the sizes every file states, and the names of the tensors they hold. Each family of the
registry (families.py) that llama.cpp writes carries one `Architecture`; gguf.py reads files
through it and gguf_export.py writes them.

Most of llama.cpp's architectures name a block's tensors alike (`block_tensors`): attn_norm,
attn_q / attn_k / attn_v (or one fused attn_qkv), attn_output, ffn_norm, ffn_gate and ffn_up
(or one fused ffn_up), ffn_down, a `.bias` beside each where the block has one. For `llama`,
llama.cpp rotates adjacent pairs (x_2i, x_2i+1) with RoPE, while Glassformer (like Hugging
Face Llama) rotates halves (x_i, x_i+d/2): its converter permutes the rows of W_Q and W_K
within each head (`permuted`), which the loader puts back (gguf.unpermute_rows). The other
architectures rotate halves in llama.cpp too (its NEOX RoPE): their rows are as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from ..model.config import ModelConfig

# llama.cpp's names of the norms after attention and the feed-forward (OLMo 2, Gemma 2)
OUTPUT_NORMS = {"post_attention_norm": "attn_out_norm", "post_ffw_norm": "mlp_out_norm"}
# The Llama block's fields that `<arch>.*` metadata does not state
LLAMA_BLOCK = {"norm": "rmsnorm", "activation": "silu", "gated": True, "attn_bias": False,
               "attn_out_bias": False, "mlp_bias": False}


@dataclass(frozen=True)
class Target:
    """Where one GGUF tensor goes: a parameter, a block of its rows, and the heads to un-permute."""

    param: str
    rows: tuple[int, int] | None = None  # [start, stop) of the parameter's rows; None: all
    heads: int | None = None  # set for W_Q / W_K stored in llama.cpp's RoPE layout
    shift: float = 0.0  # the file stores the parameter plus this (Gemma's norms: 1)


class Metadata:
    """An `arch` file's `<arch>.*` values, each checked as it is read."""

    def __init__(self, arch: str, meta: Mapping[str, Any]) -> None:
        self.arch, self.meta = arch, meta

    def optional(self, key: str) -> Any:
        return self.meta.get(f"{self.arch}.{key}")

    def get(self, key: str, default: Any = None) -> Any:
        value = self.meta.get(f"{self.arch}.{key}", default)
        if value is None:
            raise InputError(None, f"GGUF metadata lacks {self.arch}.{key}")
        return value

    def count(self, key: str, default: Any = None) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 31:
            raise InputError(None, f"GGUF metadata {self.arch}.{key} = {value!r}: "
                             "expected a positive integer")
        return value

    def number(self, key: str, default: Any = None) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e30:
            raise InputError(None, f"GGUF metadata {self.arch}.{key} = {value!r}: "
                             "expected a positive number")
        return float(value)


Fields = Callable[[Metadata, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Architecture:
    """One llama.cpp architecture: its name, the ModelConfig fields its metadata (and which
    tensors it holds) give beyond the sizes and RoPE every file states, those fields written
    back as `<arch>.*` keys (without the prefix), and its tensors' names."""

    name: str
    fields: Fields
    metadata: Callable[[ModelConfig], dict[str, Any]]
    tensors: Callable[[ModelConfig], dict[str, Target]]
    partial_rotary: bool = False  # rope.dimension_count may be less than the head
    rope_freqs: bool = False  # Llama 3.1's bands read from rope_freqs.weight (gguf_rope.py)
    claims: Callable[[ModelConfig], bool] | None = None  # what export writes as it; None: its family's


def block_tensors(c: ModelConfig, fused: bool = False, permuted: bool = False,
                  shift: float = 0.0) -> dict[str, Target]:
    """Every tensor a file of config `c` holds in llama.cpp's common names, with where it goes:
    `fused`: one attn_qkv and one ffn_up (gate rows, then up rows) as our products hold them;
    `permuted`: W_Q and W_K in llama.cpp's RoPE layout; `shift`: what each norm weight is
    stored plus."""
    H, KV, dh, ff = c.n_heads, c.kv_heads, c.head_dim, c.ff_dim
    norm_kinds = ("weight", "bias") if c.norm == "layernorm" and c.norm_bias else ("weight",)

    def norm(theirs: str, ours: str) -> dict[str, Target]:
        return {f"{theirs}.{k}": Target(f"{ours}.{k}", shift=shift if k == "weight" else 0.0)
                for k in norm_kinds}

    def product(theirs: str, ours: str, bias: bool, rows=None, heads=None) -> dict[str, Target]:
        names = {f"{theirs}.weight": Target(f"{ours}.weight", rows, heads)}
        return names | ({f"{theirs}.bias": Target(f"{ours}.bias", rows)} if bias else {})

    names = {"token_embd.weight": Target("embed.tokens.weight"), **norm("output_norm", "final_norm")}
    if not c.tie_embeddings:
        names["output.weight"] = Target("lm_head.weight")
    for i in range(c.n_layers):
        blk, b = f"blk.{i}.", f"blocks.{i}."
        norms = {} if c.norm_placement == "out" else {"attn_norm": "norm1", "ffn_norm": "norm2"}
        if c.norm_placement in ("out", "sandwich"):
            norms |= OUTPUT_NORMS
        for theirs, ours in norms.items():
            names |= norm(blk + theirs, b + ours)
        if fused:
            names |= product(blk + "attn_qkv", b + "attn.qkv", c.attn_bias)
        else:
            qkv_rows = {"q": ((0, H * dh), H), "k": ((H * dh, (H + KV) * dh), KV),
                        "v": (((H + KV) * dh, (H + 2 * KV) * dh), None)}
            for x, (rows, heads) in qkv_rows.items():
                names |= product(f"{blk}attn_{x}", b + "attn.qkv", c.attn_bias, rows,
                                 heads if permuted else None)
        if c.qk_norm != "none":
            names |= {f"{blk}attn_{x}_norm.weight": Target(f"{b}attn.{x}_norm.weight", shift=shift)
                      for x in "qk"}
        names |= product(blk + "attn_output", b + "attn.out", c.attn_out_bias)
        if c.gated and not fused:
            names |= product(blk + "ffn_gate", b + "mlp.up", c.mlp_bias, (0, ff))
            names |= product(blk + "ffn_up", b + "mlp.up", c.mlp_bias, (ff, 2 * ff))
        else:
            names |= product(blk + "ffn_up", b + "mlp.up", c.mlp_bias)
        names |= product(blk + "ffn_down", b + "mlp.down", c.mlp_bias)
    return names


def llama_block(**extra: Any) -> Fields:
    """The fields of an architecture that is Llama's block with `extra`, its norms' epsilon
    under attention.layer_norm_rms_epsilon."""
    def fields(m: Metadata, tensors: Mapping[str, Any]) -> dict[str, Any]:
        return {**LLAMA_BLOCK, "norm_eps": m.number("attention.layer_norm_rms_epsilon"), **extra}
    return fields


def rms_epsilon(c: ModelConfig) -> dict[str, Any]:
    """llama_block's metadata: the norms' epsilon."""
    return {"attention.layer_norm_rms_epsilon": c.norm_eps}


def llama_like(name: str, permuted: bool = False, rope_freqs: bool = False,
               **extra: Any) -> Architecture:
    """An architecture of Llama's block with `extra` ModelConfig fields, named alike
    (`permuted`, `rope_freqs`: as llama.cpp's `llama` has them)."""
    return Architecture(name, llama_block(**extra), rms_epsilon,
                        lambda c: block_tensors(c, permuted=permuted), rope_freqs=rope_freqs)
