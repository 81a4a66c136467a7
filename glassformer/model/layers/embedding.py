"""Token embedding and absolute positions: I_emb = E_token[ids] + E_pos[positions]
(+ E_type[token_types] for segment embeddings, then a norm where configured: BERT; the token
rows times √d_model where embed_scale: Gemma)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ...errors import InputError
from ..config import ModelConfig
from ..hooks import Hooks
from ..sites import EMBED_SITES, names
from .norm import make_norm


class SinusoidalPositions(nn.Module):
    """PE(m, 2i) = sin(m / 10000^(2i/d)), PE(m, 2i+1) = cos(m / 10000^(2i/d)) (Vaswani et al.).

    A function of the position, computed on demand: no table, no parameters.
    """

    def __init__(self, d_model: int) -> None:
        super().__init__()
        exponents = torch.arange(0, d_model, 2, dtype=torch.float32) / d_model
        self.register_buffer(
            "inv_freq", torch.exp(-math.log(10000.0) * exponents), persistent=False
        )  # (d/2,)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        angles = positions.float()[..., None] * self.inv_freq  # (B, T, d/2)
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (B, T, d)


class Embedding(nn.Module):
    def __init__(self, config: ModelConfig, hooks: Hooks) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.d_model)  # E_token (v, d)
        self.positions: nn.Module | None = None
        if config.position == "learned":
            self.positions = nn.Embedding(config.context_length, config.d_model)  # E_pos (c, d)
        elif config.position == "sinusoidal":
            self.positions = SinusoidalPositions(config.d_model)
        self.token_types = None
        if config.n_token_types:
            self.token_types = nn.Embedding(config.n_token_types, config.d_model)  # E_type (s, d)
        self.norm = make_norm(config) if config.embed_norm else None
        self.scale = config.d_model**0.5 if config.embed_scale else None  # Gemma: × √d_model
        self.hooks, self.at = hooks, names("", EMBED_SITES, "embed")  # its site names
        present = {"positions": self.positions, "token_types": self.token_types}
        hooks.register(*(site for name, site in self.at.items() if present.get(name, True) is not None))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        """token_types (B, T): segment ids, all 0 when not given."""
        x = self.tokens(ids)  # (B, T, d)
        if self.scale is not None:  # the factor in float32, then in x's dtype, as Gemma's code has it
            x = x * torch.tensor(self.scale, dtype=torch.float32, device=x.device).to(x.dtype)
        x = self.hooks(self.at["tokens"], x)
        if self.positions is not None:
            x = x + self.hooks(self.at["positions"], self.positions(positions).to(x.dtype))
        if self.token_types is not None:
            if token_types is None:
                token_types = torch.zeros_like(ids)  # (B, T)
            x = x + self.hooks(self.at["token_types"], self.token_types(token_types))
        elif token_types is not None:
            raise InputError("token_types", "this model has no token-type embeddings (n_token_types=0)")
        if self.norm is not None:
            x = self.norm(x)
        return self.hooks(self.at["out"], x)  # (B, T, d)
