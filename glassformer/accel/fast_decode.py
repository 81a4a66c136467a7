"""The decode step in one C++ call: every layer of a converted model with no Python between.

Once `quantize_model` has given a model its decode kernels, a step for one sequence is the
same arithmetic as `model(token, cache=cache)`; only the dispatch differs. Python embeds the
token, C++ (csrc/decode_step.cpp) runs norm, QKV, RoPE, the cache write, attention, W_O,
norm and feed-forward for every layer, and Python applies the final norm and head.
The model owns its step (`Transformer.fused_step`), built by `FastDecoder.build` and dropped
whenever its tensors change; `why_not` says why a model cannot take it. `rows` is the same
step for one new token of each of several sequences whose keys and values sit in a paged
pool (the serving engine's decode steps); each row's numbers are those `__call__` gives it.
"""

from __future__ import annotations

import torch

from ..model.kv_cache import KVCache
from ..model.layers.positions import rope_cos_sin
from ..model.transformer import Transformer
from .build import extension
from .quantized_linear import QuantizedLinear
from .weight_formats import WeightFormat

_ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}


def why_not(model: Transformer) -> str | None:
    """The reason `model` cannot use the fused step now, or None when it can."""
    if model.training or torch.is_grad_enabled():
        return "inference only (eval mode, no grad)"
    if model.hooks:
        return "hooks are installed: the module path shows every site"
    return _static_reason(model)


def _static_reason(model: Transformer) -> str | None:
    config, embedding = model.config, model.embed.tokens.weight
    if config.norm_placement != "pre" or not config.causal:
        return "only pre-norm causal models"
    if not all(isinstance(layer, QuantizedLinear) for layer in model.linear_layers().values()):
        return "the model has no decode kernels (see glassformer.quantize)"
    if embedding.device.type != "cpu" or embedding.dtype != torch.float32:
        return "float32 on the CPU only"
    if extension() is None:
        return "the C++ kernels are not available"
    return None


class FastDecoder:
    """The fused step of one model as it is now: it holds the model's tensors, not copies."""

    @classmethod
    def build(cls, model: Transformer) -> FastDecoder | None:
        """The step for `model`, or None where it does not apply to it."""
        return None if _static_reason(model) is not None else cls(model)

    def __init__(self, model: Transformer) -> None:
        config = model.config
        # the model's parts, not the model: a step kept alive keeps no model alive
        self.config, self.embed, self.final_norm, self.lm_head = (
            config, model.embed, model.final_norm, model.lm_head)
        self.rope = None
        if config.position == "rope":
            self.rope = (model.rope_inv_freq, model.rope_attention_factor)
        tensors: list[torch.Tensor] = []
        layout: list[int] = []
        for block in model.blocks:
            norm_bias = getattr(block.norm1, "bias", None) is not None
            layout.append(int(norm_bias))
            for norm in (block.norm1, block.norm2):
                tensors += [norm.weight.detach()] + ([norm.bias.detach()] if norm_bias else [])
            # the C++ step reads each block's four products in this order
            for linear in (block.attn.qkv, block.attn.out, block.mlp.up, block.mlp.down):
                layout += [linear.mode.code, int(linear.bias is not None)]
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
        pos, context = cache.length, self.config.context_length
        positions = torch.tensor([[pos]])  # (1, 1)
        if pos + 1 > context:
            raise ValueError(f"context: {pos + 1} tokens exceed context_length={context}")
        cache.reserve(positions, None)
        cache.allocate(token.device, torch.float32)
        x = self.embed(token[:, None], positions)[:, 0]  # (1, d)
        cos = sin = self.empty
        if self.rope is not None:
            cos, sin = rope_cos_sin(self.rope[0], positions, self.rope[1])
            cos, sin = cos.reshape(-1), sin.reshape(-1)  # (d_head,)
        x = self.step_fn.step(x, pos, cos, sin, cache.keys, cache.values)  # (1, d)
        cache.advance(1)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.lm_head(x)  # (1, V): model.head without its hook site (no hooks here)


    def rows(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             cos: torch.Tensor | None, sin: torch.Tensor | None,
             keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """The residual streams (B, d) after every layer for the embedded tokens x (B, d) at
        positions (B,); row b's token t sits at pool slot slots[b, t] (B, S), its new one at
        slots[b, positions[b]]; cos, sin (B, d_head) its angles (None without RoPE); keys,
        values per layer (n_slots, KV, d_head) float32, written at the new slots."""
        cos = self.empty if cos is None else cos.contiguous()
        sin = self.empty if sin is None else sin.contiguous()
        return self.step_fn.step_paged(x, positions, slots, cos, sin, keys, values)


def _linear_tensors(linear: QuantizedLinear) -> list[torch.Tensor]:
    names = {WeightFormat.FP32: ["weight"], WeightFormat.BF16: ["weight"],
             WeightFormat.INT8: ["qweight", "scales"],
             WeightFormat.INT4: ["qweight", "scales", "mins"]}[linear.mode]
    tensors = [getattr(linear, name) for name in names]
    return tensors + ([linear.bias] if linear.bias is not None else [])
