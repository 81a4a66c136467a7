"""Position-wise feed-forward: MLP(x) = W_down σ(W_up x), or gated: W_down (σ(W_gate x) ⊙ W_up x)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..hooks import Hooks
from ..sites import LAYER_SITES, names

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class Activation(nn.Module):
    """σ(u), or gated: σ(gate) ⊙ up for u = [gate | up] (…, 2 d_ff) -> (…, d_ff)."""

    def __init__(self, name: str, gated: bool) -> None:
        super().__init__()
        self.name, self.gated = name, gated
        self.fn = ACTIVATIONS[name]

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.fn(u)
        gate, up = u.chunk(2, dim=-1)  # (…, d_ff) each
        return self.fn(gate) * up

    def extra_repr(self) -> str:
        return f"{self.name}, gated={self.gated}"


class FeedForward(nn.Module):
    """Plain MLP (ReLU / GELU) or gated (SwiGLU = silu + gated, GeGLU = gelu + gated).

    When gated, `up` holds W_gate and W_up stacked, one product instead of two.
    """

    def __init__(self, config: ModelConfig, hooks: Hooks, block: str) -> None:
        """`block`: the site of the block it belongs to (blocks.3)."""
        super().__init__()
        width = config.ff_dim * (2 if config.gated else 1)
        self.up = nn.Linear(config.d_model, width, bias=config.mlp_bias)
        self.activation = Activation(config.activation, config.gated)
        self.down = nn.Linear(config.ff_dim, config.d_model, bias=config.mlp_bias)
        self.hooks, self.at = hooks, names(block, LAYER_SITES, "mlp")  # its site names
        self.sites = list(self.at.values())  # in the order it reaches them (its block registers them)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up(x)  # (B, T, d_ff) or (B, T, 2 d_ff)
        hidden = self.hooks(self.at["hidden"], self.activation(up))  # (B, T, d_ff)
        return self.hooks(self.at["out"], self.down(hidden))  # (B, T, d)
