"""What sits on the final hidden states besides the decoder to the vocabulary (BERT):

    mlm transform:  h' = Norm(σ(h W_t + b_t))        before the (tied) decoder + bias
    pooler:         p  = tanh(h[:, 0] W_p + b_p)     one vector per sequence, from the first token
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .feedforward import Activation
from .norm import make_norm


class MaskedLMTransform(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.activation = Activation(config.activation, gated=False)
        self.norm = make_norm(config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(self.activation(self.dense(h)))  # (…, d)


class Pooler(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(h[:, 0]))  # (B, d)


# config.head -> the transform before the decoder (None: the decoder reads h as it is)
HEAD_TRANSFORMS = {"lm": None, "mlm": MaskedLMTransform}
