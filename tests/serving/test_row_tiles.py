"""Products in row tiles: each row's result the same bits whatever the number of rows."""

import pytest
import torch
from torch import nn

from glassformer.accel.kernels import ROW_TILE
from glassformer.accel.quantized_linear import QuantizedLinear
from glassformer.serving.row_tiles import RowTiles, row_invariant

pytestmark = pytest.mark.usefixtures("kernels")


def _products(gen):
    linear = nn.Linear(40, 24)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(24, 40, generator=gen))
    return {"nn.Linear": linear, **{fmt: QuantizedLinear.from_linear(linear, fmt)
                                    for fmt in ("fp32", "bf16", "int8", "int4")}}


@pytest.mark.parametrize("name", ["nn.Linear", "fp32", "bf16", "int8", "int4"])
def test_each_row_of_any_batch_is_the_lone_row(name):
    gen = torch.Generator().manual_seed(0)
    product = row_invariant(_products(gen)[name])
    x = torch.randn(3 * ROW_TILE + 5, 40, generator=gen)  # (M, K)
    with torch.no_grad():
        alone = torch.cat([product(x[i : i + 1]) for i in range(x.shape[0])])  # (M, N)
        for m in (2, ROW_TILE, ROW_TILE + 1, x.shape[0]):
            torch.testing.assert_close(product(x[:m]), alone[:m], rtol=0, atol=0)
            torch.testing.assert_close(product(x[None, :m])[0], alone[:m], rtol=0, atol=0)


def test_only_products_without_kernels_are_tiled():
    products = _products(torch.Generator().manual_seed(0))
    for name, product in products.items():
        wrapped = row_invariant(product)
        assert isinstance(wrapped, RowTiles) == (name == "nn.Linear")
        if name in ("fp32", "bf16"):  # the same tensors, through the kernels at any rows
            assert wrapped.invariant and wrapped.weight is product.weight
