"""Each row of a weight product is the same bits whatever shares its call.

The oracle is the row computed alone (one row, M = 1). Row i of a batch must equal the lone
row exactly, wherever it sits and whatever the other rows hold, at any number of rows: for
int8 / int4 layers (GGUF blocks included, K-quants and Q5_x too) as they are, for float layers told to
(`QuantizedLinear.row_invariant`, what the serving engine uses; without it they are so up to
ROW_TILE rows). The kernels take rows in register tiles and panels (csrc/quantized.cpp), so
the row counts cover one tile, tiles with a rest, and more than one panel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glassformer.accel import kernels, ops
from glassformer.accel.kernels import ROW_TILE
from glassformer.accel.quantized_linear import QuantizedLinear

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels are not built")

FORMATS = ("fp32", "bf16", "int8", "int4", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # K-quants: test_kquants
# K: under one SIMD width, tails of 1..7 floats, part blocks of 32, odd and >8 block counts
SIZES = [(5, 7), (12, 9), (37, 20), (96, 33), (300, 17), (520, 64)]
ROWS = (1, 2, 3, 5, 8, 17, 64, 70)  # 70: past a panel of 64 rows


def _layer(fmt: str, weight: torch.Tensor, bias: torch.Tensor) -> QuantizedLinear:
    if not fmt.startswith("Q"):
        return QuantizedLinear.from_weight(weight, fmt, bias).row_invariant()
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
    x = torch.randn(max(ROWS), k, generator=gen) * 2  # (M_max, K)
    with torch.no_grad():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])  # (M_max, N)
        for m in ROWS[1:]:
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


@pytest.mark.parametrize("fmt", ("fp32", "bf16", "int8", "int4"))
def test_many_rows_compute_the_dequantized_product(fmt):
    """The invariant layer's M rows against F.linear on its float32 weight: float layers
    within float32 rounding of K terms, int layers within the rounding of the activations to
    int8 (half a step, amax / 254, per element) plus float rounding."""
    gen = torch.Generator().manual_seed(11)
    k, n = 300, 40
    layer = QuantizedLinear.from_weight(torch.randn(n, k, generator=gen) / k**0.5, fmt,
                                        torch.randn(n, generator=gen)).row_invariant()
    w = layer.dequantized_weight()  # (N, K)
    x = torch.randn(70, k, generator=gen)  # (M, K)
    with torch.no_grad():
        y = layer(x)
    rounding = 2 * (k + 2) * 2.0**-24 * (x.abs() @ w.abs().T) + 1e-5  # (M, N)
    bound = rounding
    if fmt in ("int8", "int4"):
        blocks = F.pad(x, (0, -k % 32)).reshape(70, -1, 32)  # (M, nb, 32)
        step = blocks.abs().amax(-1, keepdim=True) / 254  # (M, nb, 1)
        bound = rounding + (step.expand_as(blocks).reshape(70, -1)[:, :k]) @ w.abs().T
    assert torch.all((y - F.linear(x, w, layer.bias)).abs() <= bound)


@pytest.mark.parametrize("fmt", ("fp32", "bf16"))
def test_float_layers_use_the_kernels_at_any_rows_only_when_told(fmt):
    gen = torch.Generator().manual_seed(5)
    plain = QuantizedLinear.from_weight(torch.randn(24, 40, generator=gen), fmt)
    invariant = plain.row_invariant()
    assert invariant.invariant and not plain.invariant
    assert invariant.weight.data_ptr() == plain.weight.data_ptr()  # the tensors are shared
    x = torch.randn(3 * ROW_TILE, 40, generator=gen)  # (M, K)
    kernel = ops.linear_fp32 if fmt == "fp32" else ops.linear_bf16
    with torch.no_grad():
        expected = kernel(x, plain.weight, None, "cpp", any_rows=True)
        assert torch.equal(invariant(x), expected)
        assert torch.equal(plain(x), kernel(x, plain.weight, None, "torch"))


@pytest.mark.parametrize("fmt", ("int8", "int4"))
def test_int_layers_take_many_rows_in_one_call_as_in_tiles(fmt):
    gen = torch.Generator().manual_seed(3)
    layer = QuantizedLinear.from_weight(torch.randn(48, 72, generator=gen), fmt)
    x = torch.randn(5 * ROW_TILE + 3, 72, generator=gen)  # (M, K)
    with torch.no_grad():
        tiles = torch.cat([layer(t) for t in x.split(ROW_TILE)])  # (M, N) tile by tile
        torch.testing.assert_close(layer(x), tiles, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ("int8", "int4"))
@pytest.mark.parametrize("k", (576, 1536, 1000, 650, 200))
def test_every_tile_shape_computes_each_row_as_the_lone_row(fmt, k):
    """Every row count from 1 to 17 (whole tiles of rows and each size of the rest) on
    block counts with whole chunks of 16 blocks, a short tail, a longer tail and part blocks
    (K = 1000, 650, 200), against the row computed alone, bit for bit."""
    gen = torch.Generator().manual_seed(k)
    layer = QuantizedLinear.from_weight(torch.randn(26, k, generator=gen), fmt)
    x = torch.randn(17, k, generator=gen)  # (M_max, K)
    with torch.no_grad():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])  # (M_max, N)
        for m in range(2, x.shape[0] + 1):
            torch.testing.assert_close(layer(x[:m]), alone[:m], rtol=0, atol=0,
                                       msg=f"{fmt}, K = {k}: rows of a batch of {m}")


@pytest.mark.parametrize("fmt", ("int8", "int4", "Q4_1", "Q5_0"))
def test_a_long_prefill_computes_each_row_as_the_lone_row(fmt):
    """300 rows (several panels of 64, tiles of 16 and a rest of 8 + 4) on a shape with a
    whole chunk and a short tail (K = 576), against each row computed alone, bit for bit."""
    gen = torch.Generator().manual_seed(300)
    layer = _layer(fmt, torch.randn(24, 576, generator=gen), torch.randn(24, generator=gen))
    x = torch.randn(300, 576, generator=gen)  # (M, K)
    with torch.no_grad():
        alone = torch.cat([layer(row[None]) for row in x])  # (M, N)
        torch.testing.assert_close(layer(x), alone, rtol=0, atol=0)
        torch.testing.assert_close(layer(x[:77]), alone[:77], rtol=0, atol=0)
