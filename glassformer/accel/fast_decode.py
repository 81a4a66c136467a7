"""The decode step in one C++ call: every layer of a converted model with no Python between.

Once `quantize_model` has given a model its decode kernels, a step for one sequence is the
same arithmetic as `model(token, cache=cache)`; only the dispatch differs. Python embeds the
token, C++ (kernels/decode_step.cpp) runs norm, QKV, RoPE, the cache write, attention,
W_O, norm and feed-forward for every layer, and Python applies the final norm and head.
Used by generation when it applies (see `why_not`); the module path remains the reference.
"""

from __future__ import annotations

import weakref

import torch

from ..model.kv_cache import KVCache
from ..model.layers.positions import rope_cos_sin
from ..model.transformer import Transformer
from .build import extension
from .quantize import linear_layers
from .quantized_linear import QuantizedLinear

_MODES = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}
_ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}
_steps: weakref.WeakKeyDictionary[Transformer, FastDecoder] = weakref.WeakKeyDictionary()


def why_not(model: Transformer) -> str | None:
    """The reason `model` cannot use the fused step now, or None when it can."""
    if model.training or torch.is_grad_enabled():
        return "inference only (eval mode, no grad)"
    if model.hooks:
        return "hooks are installed: the module path shows every site"
    return None if model in _steps else _static_reason(model)


def _static_reason(model: Transformer) -> str | None:
    config = model.config
    if config.norm_placement != "pre" or not config.causal:
        return "only pre-norm causal models"
    if any(not isinstance(getattr(p, n), QuantizedLinear) for p, n in linear_layers(model)):
        return "the model has no decode kernels (see glassformer.quantize)"
    if model.embed.tokens.weight.device.type != "cpu" or model.embed.tokens.weight.dtype != torch.float32:
        return "float32 on the CPU only"
    if extension() is None:
        return "the C++ kernels are not available"
    return None


def fast_decoder(model: Transformer) -> FastDecoder | None:
    """The fused step for `model`, built once; None where it does not apply."""
    if why_not(model) is not None:
        return None
    if model not in _steps:  # built once: the weights are shared, not copied
        _steps[model] = FastDecoder(model)
    return _steps[model]


class FastDecoder:
    def __init__(self, model: Transformer) -> None:
        config = model.config
        self.model = model
        tensors: list[torch.Tensor] = []
        layout: list[int] = []
        for block in model.blocks:
            norm_bias = getattr(block.norm1, "bias", None) is not None
            layout.append(int(norm_bias))
            for norm in (block.norm1, block.norm2):
                tensors += [norm.weight.detach()] + ([norm.bias.detach()] if norm_bias else [])
            for linear in (block.attn.qkv, block.attn.out, block.mlp.up, block.mlp.down):
                layout += [_MODES[linear.mode], int(linear.bias is not None)]
                tensors += _linear_tensors(linear)
        sizes = [config.d_model, config.n_heads, config.kv_heads, config.head_dim,
                 config.ff_dim, config.sliding_window or 0]
        slopes = getattr(model, "alibi_slopes", None)
        self.step_fn = extension().DecodeStep(
            sizes, config.norm == "rmsnorm", config.gated, config.position == "rope",
            _ACTIVATIONS[config.activation], config.norm_eps, tensors, layout,
            None if slopes is None else slopes.float().contiguous(),
        )
        self.empty = torch.empty(0)

    def __call__(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Next-token logits (1, V) for `token` (1,) at position cache.length."""
        model, pos = self.model, cache.length
        positions = torch.tensor([[pos]])  # (1, 1)
        if pos + 1 > model.config.context_length:
            raise ValueError(f"context: {pos + 1} tokens exceed "
                             f"context_length={model.config.context_length}")
        cache.reserve(positions, None)
        cache.allocate(token.device, torch.float32)
        x = model.embed(token[:, None], positions)[:, 0]  # (1, d)
        cos = sin = self.empty
        if model.config.position == "rope":
            cos, sin = rope_cos_sin(model.rope_inv_freq, positions, model.rope_attention_factor)
            cos, sin = cos.reshape(-1), sin.reshape(-1)  # (d_head,)
        x = self.step_fn.step(x, pos, cos, sin, cache.keys, cache.values)  # (1, d)
        cache.advance(1)
        if model.final_norm is not None:
            x = model.final_norm(x)
        return model.head(x)  # (1, V)


def _linear_tensors(linear: QuantizedLinear) -> list[torch.Tensor]:
    names = {"fp32": ["weight"], "bf16": ["weight"], "int8": ["qweight", "scales"],
             "int4": ["qweight", "scales", "mins"]}[linear.mode]
    tensors = [getattr(linear, name) for name in names]
    return tensors + ([linear.bias] if linear.bias is not None else [])
