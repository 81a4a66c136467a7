"""Each row of a weight product is the same bits whatever shares its call.

The oracle is the row computed alone (one row, M = 1). Row i of a batch must equal the lone
row exactly, wherever it sits and whatever the other rows hold: for int8 / int4 layers (GGUF
blocks included) at any number of rows, for float layers up to ROW_TILE rows (beyond, the
serving engine calls them in tiles: tests/serving/test_row_tiles.py).
"""

from __future__ import annotations

import pytest
import torch

from glassformer.accel import kernels
from glassformer.accel.kernels import ROW_TILE
from glassformer.accel.quantized_linear import QuantizedLinear

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels are not built")

FORMATS = ("fp32", "bf16", "int8", "int4", "Q8_0", "Q4_0", "Q4_1")
# K: under one SIMD width, tails of 1..7 floats, part blocks of 32, odd and >8 block counts
SIZES = [(5, 7), (12, 9), (37, 20), (96, 33), (300, 17), (520, 64)]


def _layer(fmt: str, weight: torch.Tensor, bias: torch.Tensor) -> QuantizedLinear:
    if not fmt.startswith("Q"):
        return QuantizedLinear.from_weight(weight, fmt, bias)
    gguf = pytest.importorskip("gguf")
    kind = gguf.GGMLQuantizationType[fmt]
    raw = gguf.quants.quantize(weight.numpy(), kind)  # (N, bytes per row) uint8
    return QuantizedLinear.from_gguf(raw, kind, tuple(weight.shape), bias)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("k", "n"), SIZES)
def test_each_row_is_the_lone_row_bit_for_bit(fmt, k, n):
    if fmt.startswith("Q") and k % 32:
        pytest.skip("GGUF rows hold whole blocks of 32")
    gen = torch.Generator().manual_seed(k * 1000 + n)
    layer = _layer(fmt, torch.randn(n, k, generator=gen), torch.randn(n, generator=gen))
    m_max = ROW_TILE if fmt in ("fp32", "bf16") else ROW_TILE + 13
    x = torch.randn(m_max, k, generator=gen) * 2  # (M_max, K)
    with torch.no_grad():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])  # (M_max, N)
        for m in range(2, x.shape[0] + 1):
            rows = x[:m]
            torch.testing.assert_close(layer(rows), alone[:m], rtol=0, atol=0,
                                       msg=f"{fmt}: rows of a batch of {m}")
            flipped = layer(rows.flip(0)).flip(0)  # each row at another index
            torch.testing.assert_close(flipped, alone[:m], rtol=0, atol=0,
                                       msg=f"{fmt}: rows of a reversed batch of {m}")
        others = torch.cat([x[:1], torch.randn(ROW_TILE - 1, k, generator=gen) * 50])
        torch.testing.assert_close(layer(others)[:1], alone[:1], rtol=0, atol=0,
                                   msg=f"{fmt}: a row among large ones")
        torch.testing.assert_close(layer(x[None])[0], alone, rtol=0, atol=0,
                                   msg=f"{fmt}: a (1, M, K) input")


@pytest.mark.parametrize("fmt", ("int8", "int4"))
def test_int_layers_take_many_rows_in_one_call_as_in_tiles(fmt):
    gen = torch.Generator().manual_seed(3)
    layer = QuantizedLinear.from_weight(torch.randn(48, 72, generator=gen), fmt)
    x = torch.randn(5 * ROW_TILE + 3, 72, generator=gen)  # (M, K)
    with torch.no_grad():
        tiles = torch.cat([layer(t) for t in x.split(ROW_TILE)])  # (M, N) tile by tile
        torch.testing.assert_close(layer(x), tiles, rtol=0, atol=0)
