"""Normalisation: LayerNorm (Ba et al., 2016) and RMSNorm (Zhang & Sennrich, 2019)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig


class LayerNorm(nn.Module):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias, over the last dimension."""

    def __init__(self, d_model: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))  # (d,)
        self.bias = nn.Parameter(torch.zeros(d_model)) if bias else None  # (d,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) * weight: no centring, no bias (computed in float32).

    With an `offset` (Gemma: 1) the scale is (offset + weight), applied in float32 before the
    result returns to x's dtype, and a new norm's weight starts at 1 - offset (a scale of 1)."""

    def __init__(self, d_model: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((d_model,), 1.0 - offset))  # (d,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, offset={self.offset}" if self.offset else f"eps={self.eps}"


class QKNorm(RMSNorm):
    """RMSNorm of queries or keys (B, heads, T, d_head): over each head's d_head (Qwen3), or
    over all heads side by side, heads · d_head wide (OLMo 2: `over_heads`); `offset` as
    RMSNorm's (Gemma 3: 1)."""

    def __init__(self, n_heads: int, d_head: int, eps: float, over_heads: bool,
                 offset: float = 0.0) -> None:
        super().__init__(n_heads * d_head if over_heads else d_head, eps, offset)
        self.over_heads = over_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.over_heads:
            return super().forward(x)
        B, H, T, D = x.shape
        whole = x.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H·d_head): heads side by side
        return super().forward(whole).view(B, T, H, D).transpose(1, 2)  # (B, H, T, d_head)


def make_norm(config: ModelConfig) -> nn.Module:
    """The configured norm over d_model."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps, config.norm_weight_offset)
    return LayerNorm(config.d_model, config.norm_eps, config.norm_bias)
