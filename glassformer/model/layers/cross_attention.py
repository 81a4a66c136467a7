"""Cross-attention, the encoder-decoder's bridge: queries from the decoder, keys and values from
the encoder's output, no causal mask.

    Q    = x W_Q                 x (B, T, d): the decoder's stream
    K, V = m W_K, m W_V          m (B, S, d): the encoder's output, projected once per input
    A    = Q Kᵀ / √d_head + M    M: only the encoder's padding
    out  = softmax(A) V  ->  concat heads  ->  W_O
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..hooks import Hooks
from ..sites import CROSS_SITES, WEIGHT_SITES, names
from .attention_backends import KERNELS, reference_attention
from .masking import AttentionMask


class CrossAttention(nn.Module):
    def __init__(self, config: ModelConfig, hooks: Hooks, block: str) -> None:
        """`block`: the site of the decoder block it belongs to (decoder.blocks.3)."""
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_head = config.n_heads, config.kv_heads, config.head_dim
        q_width, kv_width = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        self.q = nn.Linear(config.d_model, q_width, bias=config.attn_bias)
        self.kv = nn.Linear(config.d_model, 2 * kv_width, bias=config.attn_bias)  # [W_K | W_V]
        self.out = nn.Linear(q_width, config.d_model, bias=config.attn_out_bias)
        self.kernel = KERNELS[config.attention_kernel]
        self.scale = None if config.scale_scores else 1.0
        self.dropout = config.dropout
        self.hooks, self.at = hooks, names(block, CROSS_SITES, "cross")  # its site names
        self.sites = list(self.at.values())  # in the order it reaches them (its block registers them)

    def project(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder output m (B, S, d) as keys and values, each (B, KV, S, d_head)."""
        B, S, _ = memory.shape
        kv = self.kv(memory).view(B, S, 2, self.n_kv_heads, self.d_head)  # (B, S, 2, KV, d_head)
        k, v = kv.permute(2, 0, 3, 1, 4)  # (B, KV, S, d_head) each
        return k, v

    def forward(
        self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        B, T, _ = x.shape
        hook, at = self.hooks, self.at
        q = self.q(x).view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, d_head)
        q = hook(at["q"], q)
        dropout = self.dropout if self.training else 0.0
        if hook and any(hook.wants(at[name]) for name in WEIGHT_SITES):
            context, _ = reference_attention(
                q, k, v, mask, dropout, hook=lambda name, t: hook(at[name], t),
                scale=self.scale,
            )  # pattern (B, H, T, S): decoder tokens × encoder tokens
        else:
            context = self.kernel(q, k, v, mask, dropout, scale=self.scale)  # (B, H, T, d_head)
        merged = hook(at["context"], context).transpose(1, 2).reshape(B, T, -1)  # (B, T, H·d_head)
        return hook(at["out"], self.out(merged))  # (B, T, d)
