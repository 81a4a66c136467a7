"""Products whose rows never depend on how many rows share the call (the engine's batch
invariance, runner.py). The kernels of a QuantizedLinear compute each row on its own at any
number of rows (accel/csrc/quantized.cpp; float layers once told to: `row_invariant`); every
other product goes through PyTorch's BLAS, which picks kernels by shape (and on some CPUs sums
a row in another order at another number of rows), so it runs in tiles of exactly ROW_TILE
rows. `tile_norms` tiles a view's norms too (on CUDA a row's reduction is split by the call's
size; the deterministic engine tiles them).
"""

from __future__ import annotations

import torch
from torch import nn

from ..accel import kernels
from ..accel.kernels import ROW_TILE
from ..accel.quantized_linear import QuantizedLinear
from ..accel.stacked_linear import StackedLinear
from ..model.layers.norm import LayerNorm, QKNorm, RMSNorm


def row_invariant(product: nn.Module) -> nn.Module:
    """`product` computing each row independently of the call's size: through the kernels
    where it has them, else in row tiles."""
    if (isinstance(product, (QuantizedLinear, StackedLinear)) and product.backend != "torch"
            and kernels.available()):
        return product.row_invariant()  # a block layer (int8, int4, GGUF's) is itself
    return RowTiles(product)


class RowTiles(nn.Module):
    """product(x) for x (..., K), computed ROW_TILE rows at a time: (..., N)."""

    def __init__(self, product: nn.Module) -> None:
        super().__init__()
        self.product = product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (M, K)
        m = rows.shape[0]
        padded = nn.functional.pad(rows, (0, 0, 0, -m % ROW_TILE))  # (M', K): whole tiles, zeros after
        ys = [self.product(tile) for tile in padded.split(ROW_TILE)]  # (ROW_TILE, N) each
        y = (torch.cat(ys) if len(ys) > 1 else ys[0])[:m]  # (M, N)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def tile_norms(view: nn.Module) -> None:
    """Run every norm of `view` (a copy the engine owns) in row tiles: each row's mean over
    its own features, in calls of ROW_TILE rows. A QK-norm over all heads side by side
    (OLMo 2) stays as it is: its rows are (B, T) across the heads."""
    for name, module in list(view.named_modules()):
        per_row = type(module) in (LayerNorm, RMSNorm) or (type(module) is QKNorm and not module.over_heads)
        if per_row:
            view.set_submodule(name, RowTiles(module))
