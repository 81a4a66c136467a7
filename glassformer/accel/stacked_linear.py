"""StackedLinear: one product whose output rows are held in parts of different formats.

A GGUF file stores a block's q, k and v (and its gate and up) as tensors of their own, each in
the block type its quantizer chose: a Q4_K_M file holds q and k in Q4_K and, on some layers, v
in Q6_K. Glassformer multiplies by q; k; v as one product (attn.qkv). A StackedLinear holds
each part as the QuantizedLinear of its own blocks, so no part is requantized or widened to
float32, and writes their outputs side by side, its parts' rows in order; the fused decode
step does the same in C++ (kernels.LinearWeights' parts).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InputError
from . import kernels
from .quantized_linear import QuantizedLinear
from .weight_formats import WeightFormat


class StackedLinear(nn.Module):
    """y = x @ [W_1; W_2; ...]^T (+ each part's bias): the parts' outputs (..., N_i) side by
    side (..., N), each part a QuantizedLinear of the same input features."""

    def __init__(self, parts: list[QuantizedLinear]) -> None:
        super().__init__()
        if len(parts) < 2 or len({part.in_features for part in parts}) != 1:
            raise InputError(None, "a stacked product takes two or more parts of one input size")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        self.backend = parts[0].backend

    @property
    def bias(self) -> torch.Tensor | None:
        """The parts' biases (N,) side by side (zeros for a part without one), or None."""
        if all(part.bias is None for part in self.parts):
            return None
        return torch.cat([torch.zeros(part.out_features) if part.bias is None else part.bias
                          for part in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], -1)  # (..., N)

    def dequantized_weight(self) -> torch.Tensor:
        """The (out_features, in_features) float32 weight: the parts' rows in order."""
        return torch.cat([part.dequantized_weight() for part in self.parts])

    def row_invariant(self) -> StackedLinear:
        """This product computing each row alike at any number of rows (each part so)."""
        parts = [part.row_invariant() for part in self.parts]
        if all(new is old for new, old in zip(parts, self.parts, strict=True)):
            return self
        return StackedLinear(parts)

    def kernel_weights(self) -> kernels.LinearWeights:
        """The parts as the fused decode step reads them (the format and tensors unused)."""
        return kernels.LinearWeights(WeightFormat.FP32, [], None,
                                     tuple(part.kernel_weights() for part in self.parts))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
