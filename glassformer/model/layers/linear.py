"""Linear: nn.Linear (y = x W^T + b), whose training products may take a faster route."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...accel import onednn


class Linear(nn.Linear):
    """nn.Linear, same parameters and state dict. While training on a CPU whose AVX-512 MKL
    leaves unused, the products run through oneDNN (kernels/onednn.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = onednn.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) if y is None else y
