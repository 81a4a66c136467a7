"""Products whose rows never depend on how many rows share the call (the serving engine's
batch invariance, runner.py).

An int8 / int4 layer (accel/quantized_linear.py) already computes each row on its own
whatever the number of rows, so it is used as it is. The float layers' C++ kernels do so
for up to ROW_TILE rows and hand more to one large product, whose summation order may
change with the number of rows; products without such kernels (plain nn.Linear) may change
it with any number of rows, so their tiles are padded to exactly ROW_TILE rows: one fixed
shape, one code path.
"""

from __future__ import annotations

import torch
from torch import nn

from ..accel.kernels import ROW_TILE
from ..accel.quantized_linear import QuantizedLinear
from ..accel.weight_formats import WeightFormat


def row_invariant(product: nn.Module) -> nn.Module:
    """`product` itself where its rows are already independent of the call's size, else
    the product in row tiles."""
    if isinstance(product, QuantizedLinear) and product.mode in (WeightFormat.INT8, WeightFormat.INT4):
        return product
    return RowTiles(product)


class RowTiles(nn.Module):
    """product(x) for x (..., K), computed ROW_TILE rows at a time: (..., N)."""

    def __init__(self, product: nn.Module) -> None:
        super().__init__()
        self.product = product
        self.pad = not isinstance(product, QuantizedLinear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (M, K)
        outs = []
        for i in range(0, rows.shape[0], ROW_TILE):
            tile = rows[i : i + ROW_TILE]
            m = tile.shape[0]
            if self.pad and m < ROW_TILE:
                tile = torch.cat([tile, tile.new_zeros(ROW_TILE - m, tile.shape[1])])
            outs.append(self.product(tile)[:m])
        y = torch.cat(outs) if len(outs) > 1 else outs[0]  # (M, N)
        return y.reshape(*x.shape[:-1], y.shape[-1])
