"""Every entry point of the C++ kernels as a typed function: the one module that calls the
compiled extension (`build.extension()`), so each kernel has one owner on the Python side.

The functions are grouped by the file under csrc/ that computes them, and named as there.
Each calls the extension as it is now; a caller checks `available()` first (they raise
where there is no build). `ROW_TILE` is the most rows one call of the small-batch kernels
takes (compiled into them from build.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..model.config import ModelConfig
from . import build, decisions
from .build import ROW_TILE as ROW_TILE  # re-exported: the row tile's one name outside accel/
from .weight_formats import WeightFormat

Tensor = torch.Tensor


def extension():
    """The compiled kernels of the build this machine's decision names, or None."""
    return build.extension(decisions.kernel_target().choice)


def available() -> bool:
    """Whether the C++ kernels are built for this process (`build.why_unavailable` says why
    not)."""
    return extension() is not None


# ------------------------------------------------------------------ matvec.cpp (float weights)

def linear_f32(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (M, K) float32 @ weight (N, K) float32ᵀ (+ bias) -> (M, N)."""
    return extension().linear_f32(x, weight, bias)


def linear_bf16(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (M, K) float32 @ weight (N, K) bfloat16ᵀ (+ bias) -> (M, N), float32 products."""
    return extension().linear_bf16(x, weight, bias)


def try_f32(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """linear_f32 for x (..., K) of at most ROW_TILE contiguous float32 rows that need no
    gradient, else None."""
    return extension().try_f32(x, weight, bias)


def try_bf16(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """linear_bf16 as try_f32 takes it, else None."""
    return extension().try_bf16(x, weight, bias)


# --------------------------------------------------------- quantized.cpp (blocks of 32 weights)

def linear_q8(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """x (M, K) float32 @ the int8 blocks' weightᵀ (+ bias) -> (M, N)."""
    return extension().linear_q8(x, qweight, scales, bias)


def linear_q4(x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor,
              bias: Tensor | None) -> Tensor:
    """x (M, K) float32 @ the int4 blocks' weightᵀ (+ bias) -> (M, N)."""
    return extension().linear_q4(x, qweight, scales, mins, bias)


def try_q8(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None,
           in_features: int) -> Tensor | None:
    """linear_q8 for x (..., in_features) as try_f32 takes it, else None."""
    return extension().try_q8(x, qweight, scales, bias, in_features)


def try_q4(x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor, bias: Tensor | None,
           in_features: int) -> Tensor | None:
    """linear_q4 for x (..., in_features) as try_f32 takes it, else None."""
    return extension().try_q4(x, qweight, scales, mins, bias, in_features)



def dequantize(qweight: Tensor, scales: Tensor, mins: Tensor | None, in_features: int) -> Tensor:
    """The (N, in_features) float32 weight of int8 (mins None) or int4 blocks in block order."""
    return extension().dequantize(qweight, scales, mins, in_features)


# ------------------------------------------ kquants.cpp (GGUF's K-quant and 5-bit blocks as stored)

def linear_gguf(x: Tensor, qweight: Tensor, fmt: WeightFormat, bias: Tensor | None) -> Tensor:
    """x (M, K) float32 @ the weightᵀ of rows of `fmt` blocks (N, row bytes) uint8 (+ bias) ->
    (M, N), the activations quantized to int8 per block of 32 (kquants.py)."""
    ext = extension()
    return ext.linear_gguf(x, qweight, ext.WeightFormat.__members__[fmt.value], bias)


def dequantize_gguf(qweight: Tensor, fmt: WeightFormat, in_features: int) -> Tensor:
    """The (N, in_features) float32 weight of rows of `fmt` blocks."""
    ext = extension()
    return ext.dequantize_gguf(qweight, ext.WeightFormat.__members__[fmt.value], in_features)


# ------------------------------------------------------- decode_step.cpp (every layer at once)

class LinearWeights(NamedTuple):
    """One product of a block as the decode step reads it: fp32 / bf16 (weight,), int8
    (qweight, scales), int4 (qweight, scales, mins), GGUF's blocks as stored (qweight,); or a
    product held in parts, each its own LinearWeights, whose outputs go side by side."""

    format: WeightFormat
    tensors: list[Tensor]
    bias: Tensor | None
    parts: tuple[LinearWeights, ...] = ()  # a product held in parts (stacked_linear.py): theirs


NormWeights = tuple[Tensor, Tensor | None]  # (weight, bias or None)


class LayerWeights(NamedTuple):
    """One block: its four products and its norms, each None where the block has none: the
    input norms (pre, sandwich), the query and key norms (qk_norm: (d_head) or (heads·d_head)),
    the output norms (out, sandwich)."""

    norm1: NormWeights | None
    qkv: LinearWeights
    out: LinearWeights
    norm2: NormWeights | None
    up: LinearWeights
    down: LinearWeights
    q_norm: NormWeights | None
    k_norm: NormWeights | None
    attn_out_norm: NormWeights | None
    mlp_out_norm: NormWeights | None


def decode_step(config: ModelConfig, layers: list[LayerWeights], alibi_slopes: Tensor | None):
    """The C++ DecodeStep of a causal decoder of `config` with these layers: its `step` (one
    sequence, a dense cache) and `step_paged` (one token of each of several sequences, a paged
    pool, each row with its LoRA adapter or none: `adapter_weights`). fast_decode.py refuses
    the configurations it does not compute (its capability table); this passes each field by
    name, the scores' scale as the attention module takes it (attn_scale^-½, d_head^-½ or 1),
    and each layer's kind of RoPE angles as its Attention picks them (0 every layer's, 1 the
    sliding layers' own: `ModelConfig.local_rope`)."""
    ext = extension()
    spec = ext.DecodeConfig()
    spec.d_model, spec.n_heads, spec.n_kv_heads = config.d_model, config.n_heads, config.kv_heads
    spec.d_head, spec.d_ff = config.head_dim, config.ff_dim
    spec.windows = [config.window_of(layer) or 0 for layer in range(config.n_layers)]
    spec.norm, spec.norm_offset = ext.Norm.__members__[config.norm], config.norm_weight_offset
    spec.qk_norm = ext.QkNorm.__members__[config.qk_norm]
    spec.activation = ext.Activation.__members__[config.activation]
    spec.gated, spec.rope, spec.norm_eps = config.gated, config.position == "rope", config.norm_eps
    spec.rotary_dim, spec.parallel = config.rotated_dim, config.parallel_block
    spec.rope_kinds = [int(config.local_rope(layer)) for layer in range(config.n_layers)]
    spec.score_scale = config.head_dim**-0.5 if config.scale_scores else 1.0
    if config.attn_scale is not None:
        spec.score_scale = config.attn_scale**-0.5
    spec.softcap = config.attn_softcap or 0.0

    def linear(weights: LinearWeights):
        return ext.LinearWeights(ext.WeightFormat.__members__[weights.format.value],
                                 weights.tensors, weights.bias, [linear(p) for p in weights.parts])

    def norm(weights: NormWeights | None):
        return None if weights is None else ext.NormWeights(*weights)

    built = [ext.LayerWeights(norm(layer.norm1), linear(layer.qkv), linear(layer.out),
                              norm(layer.norm2), linear(layer.up), linear(layer.down),
                              *(norm(n) for n in (layer.q_norm, layer.k_norm, layer.attn_out_norm,
                                                  layer.mlp_out_norm)))
             for layer in layers]
    return ext.DecodeStep(spec, built, alibi_slopes)


class LoRAUpdate(NamedTuple):
    """A LoRA adapter's update of one product in one layer as the decode step reads it:
    `down` (n·r, d_in) float32, the n targets' A stacked, then per target its first output row
    and scale · B (rows, r) float32."""

    down: Tensor
    ups: list[tuple[int, Tensor]]


LORA_PRODUCTS = ("qkv", "out", "up", "down")  # a LayerWeights' products an adapter may update


def adapter_weights(layers: list[dict[str, LoRAUpdate]]):
    """One adapter for `step_paged`, built once and passed to each step by reference: per
    layer, product name (LORA_PRODUCTS) -> its update; a product absent is left as it is."""
    ext = extension()

    def update(lora: LoRAUpdate | None):
        if lora is None:
            return ext.LoRAUpdate()
        # each B transposed (r, rows): the step takes 8 outputs at a time
        return ext.LoRAUpdate(lora.down, [start for start, _ in lora.ups],
                              [b.t().contiguous() for _, b in lora.ups])

    return ext.AdapterWeights([ext.LoRALayer(*(update(layer.get(p)) for p in LORA_PRODUCTS))
                               for layer in layers])


# ---------------------------------------------------------------- bindings.cpp (OpenMP)

def release_thread_pool() -> bool:
    """Ends the worker threads of the calling thread's OpenMP team (each thread that runs a
    parallel region keeps a team of its own); they start again at its next parallel region.
    False where the OpenMP runtime refused."""
    return extension().release_thread_pool()


# ---------------------------------------------------------------- greedy.cpp

def argmax_rows(logits: Tensor) -> Tensor:
    """torch.argmax(logits, -1) for contiguous (R, V) float32 logits: (R,) int64."""
    return extension().argmax_rows(logits)


# ------------------------------------- train_autograd.cpp (training's passes as autograd nodes)

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x²) + eps) * weight over the last dimension."""
    return extension().rms_norm(x, weight, eps)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight (+ bias) over the last dimension."""
    return extension().layer_norm(x, weight, bias, eps)


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x cos + rotate_half(x) sin for x (B, H, T, D), cos and sin (B or 1, T, D) contiguous."""
    return extension().rotary(x, cos, sin)


def swiglu(h: Tensor) -> Tensor:
    """silu(gate) * up for h = [gate | up] (..., 2F) -> (..., F)."""
    return extension().swiglu(h)


def gelu(x: Tensor) -> Tensor:
    """x Φ(x), the exact GELU (its erf within 1.5e-7)."""
    return extension().gelu(x)


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
    """softmax(scale Q Kᵀ (+ causal mask)) V for q (B, H, T, D), k, v (B, KV, T, D)
    (attention_train.cpp computes it)."""
    return extension().attention(q, k, v, causal, scale)


# ---------------------------------------------------------------- train_ops.cpp

def transpose(x: Tensor) -> Tensor:
    """A contiguous (M, K) float32 matrix as a contiguous (K, M) one."""
    return extension().transpose(x)


# ---------------------------------------------------------------- grad_clip.cpp

def clip_grad_norm(grads: list[Tensor], max_norm: float) -> Tensor:
    """Scales contiguous float32 gradients in place by min(1, max_norm / (norm + 1e-6));
    returns the total norm."""
    return extension().clip_grad_norm(grads, max_norm)


# ---------------------------------------------------------------- newton_schulz.cpp

def newton_schulz(stack: Tensor, a: float, b: float, c: float, steps: int) -> Tensor:
    """Muon's Newton–Schulz iterations on a float32 stack (n, short, long) of matrices of
    Frobenius norm 1."""
    return extension().newton_schulz(stack, a, b, c, steps)


def muon_update(params: list[Tensor], grads: list[Tensor], buffers: list[Tensor],
                rates: list[float], momentum: float, nesterov: bool, a: float, b: float,
                c: float, steps: int, eps: float, decay: float) -> None:
    """torch.optim.Muon's step on float32 matrices in place, a matrix per task; `decay` is
    1 - lr · weight_decay."""
    extension().muon_update(params, grads, buffers, rates, momentum, nesterov, a, b, c, steps,
                            eps, decay)
