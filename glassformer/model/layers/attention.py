"""Masked multi-head attention with n_kv_heads key/value heads (MHA, GQA, MQA).

    Q, K, V = x W_Q, x W_K, x W_V          one fused product, split into heads
    Q, K    = Norm_Q(Q), Norm_K(K)         qk_norm: RMSNorm over each head ("head") or over
                                           all heads together ("all")
    Q, K    = rope(Q), rope(K)             when position = "rope" (a cache that positions its
                                           keys itself, the sink policy, rotates K: sink.py);
                                           a sliding layer turns by its own base where
                                           rope_local_theta is set (Gemma 3)
    K, V    = cache[...] + (K, V)          when decoding: the new rows join the cached ones
                                           (the cache calls back `context`, see kv_cache.py)
    A       = Q Kᵀ / √d_head + M           M: -inf where masked (+ ALiBi or T5 relative bias);
                                           T5 leaves out the 1/√d_head (scale_scores=False),
                                           Gemma takes attn_scale^-½ instead; Gemma 2
                                           soft-caps Q Kᵀ·scale to c·tanh(·/c) before M
                                           (the reference kernel: no fused one has it);
                                           a layer with its own window (layer_windows)
                                           narrows M to it, whoever built M
    out     = softmax(A) V  ->  concat heads  ->  W_O
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..hooks import Hooks
from ..kv_cache import AttentionCache
from ..sites import LAYER_SITES, WEIGHT_SITES, names
from .attention_backends import KERNELS, reference_attention
from .masking import AttentionMask
from .norm import QKNorm
from .positions import RopeAngles, Rotary


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, hooks: Hooks, block: str, layer: int) -> None:
        """`block`: the site of the block it belongs to (blocks.3); `layer`: its index."""
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_head = config.n_heads, config.kv_heads, config.head_dim
        self.layer = layer
        q_width, kv_width = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        self.split = (q_width, kv_width, kv_width)
        self.qkv = nn.Linear(config.d_model, q_width + 2 * kv_width, bias=config.attn_bias)
        self.out = nn.Linear(q_width, config.d_model, bias=config.attn_out_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm != "none":
            over_heads = config.qk_norm == "all"
            offset = config.norm_weight_offset  # Gemma 3: times (1 + w), as its other norms
            self.q_norm = QKNorm(self.n_heads, self.d_head, config.norm_eps, over_heads, offset)
            self.k_norm = QKNorm(self.n_kv_heads, self.d_head, config.norm_eps, over_heads, offset)
        self.rotary = Rotary() if config.position == "rope" else None
        self.rope_kind = int(config.local_rope(layer))  # which of the RopeAngles it turns by
        self.kernel = KERNELS[config.attention_kernel]
        self.scale = None if config.scale_scores else 1.0  # None: the kernels' 1/√d_head
        if config.attn_scale is not None:
            self.scale = config.attn_scale**-0.5
        self.softcap = config.attn_softcap
        # its own window where windows differ by layer; None: the mask's as the model built it
        self.window = config.window_of(layer) if config.layer_windows is not None else None
        self.narrows = config.layer_windows is not None and self.window is not None
        self.dropout = config.dropout
        self.hooks, self.at = hooks, names(block, LAYER_SITES, "attn")  # its site names: at["q"]
        # the sites it has, in the order it reaches them (its block registers them)
        self.sites = [site for name, site in self.at.items()
                      if self.q_norm is not None or name not in ("q_norm", "k_norm")]

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask | None,
        rope: RopeAngles | None = None,
        cache: AttentionCache | None = None,
    ) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d). `mask` may be None only for a cache that builds its own
        masks (the serving engine's paged view); `rope`: the angles of each kind of layer."""
        B, T, _ = x.shape
        hook, at = self.hooks, self.at
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        q = q.view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, d_head)
        k = k.view(B, T, self.n_kv_heads, self.d_head).transpose(1, 2)  # (B, KV, T, d_head)
        v = v.view(B, T, self.n_kv_heads, self.d_head).transpose(1, 2)  # (B, KV, T, d_head)
        if self.q_norm is not None:
            q, k = hook(at["q_norm"], self.q_norm(q)), hook(at["k_norm"], self.k_norm(k))
        if rope is not None:
            cos, sin = rope[self.rope_kind]
            q = self.rotary(q, cos, sin)
            if cache is None or not cache.rotates_keys:  # else rotated at their cache positions
                k = self.rotary(k, cos, sin)
        q, k, v = hook(at["q"], q), hook(at["k"], k), hook(at["v"], v)
        if cache is None:
            context = self.context(q, k, v, mask)  # (B, H, T, d_head)
        else:
            context = cache.attend(self.layer, q, k, v, mask, self.context)
        context = hook(at["context"], context)
        merged = context.transpose(1, 2).reshape(B, T, -1)  # (B, T, H·d_head): heads side by side
        return hook(at["out"], self.out(merged))  # (B, T, d)

    def context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: AttentionMask) -> torch.Tensor:
        """softmax(Q Kᵀ · scale + M) V: (B, H, Tq, d_head) for q (B, H, Tq, d_head) and k, v
        (B, KV, Tk, d_head). The one attention function of this layer, whoever holds the keys."""
        hook, at = self.hooks, self.at
        dropout = self.dropout if self.training else 0.0
        if self.narrows:
            mask = mask.narrowed(self.window)
        if self.softcap is not None or (
                hook and any(hook.wants(at[name]) for name in WEIGHT_SITES)):
            return reference_attention(
                q, k, v, mask, dropout, hook=lambda name, t: hook(at[name], t),
                scale=self.scale, softcap=self.softcap,
            )[0]
        return self.kernel(q, k, v, mask, dropout, scale=self.scale)
