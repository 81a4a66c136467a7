"""Position-wise feed-forward: MLP(x) = W_down σ(W_up x), or gated: W_down (σ(W_gate x) ⊙ W_up x)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...accel import fused as fused_ops
from ..config import ModelConfig
from ..hooks import Hooks
from .linear import Linear

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class FeedForward(nn.Module):
    """Plain MLP (ReLU / GELU) or gated (SwiGLU = silu + gated, GeGLU = gelu + gated).

    When gated, `up` holds W_gate and W_up stacked, one product instead of two.
    """

    def __init__(self, config: ModelConfig, hooks: Hooks, site: str) -> None:
        super().__init__()
        self.gated = config.gated
        self.activation = ACTIVATIONS[config.activation]
        width = config.ff_dim * (2 if config.gated else 1)
        self.up = Linear(config.d_model, width, bias=config.mlp_bias)
        self.down = Linear(config.ff_dim, config.d_model, bias=config.mlp_bias)
        self.hooks, self.site = hooks, site

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up(x)  # (B, T, d_ff) or (B, T, 2 d_ff)
        fused = fused_ops.swiglu(up) if self.gated and self.activation is F.silu else None
        if fused is not None:  # training on the CPU: one pass, one gradient tensor
            hidden = fused
        elif self.gated:
            gate, up = up.chunk(2, dim=-1)  # (B, T, d_ff) each
            hidden = self.activation(gate) * up
        else:
            hidden = self.activation(up)
        hidden = self.hooks(self.site + ".hidden", hidden)  # (B, T, d_ff)
        return self.hooks(self.site + ".out", self.down(hidden))  # (B, T, d)
