"""GGUF's K-quants and 5-bit blocks held as the file stores them (accel/kquants.py,
csrc/kquants.cpp), on random but valid blocks (random bytes, finite fp16 scales):
- the weights equal gguf.quants.dequantize bit for bit (PyTorch and both C++ builds);
- the product equals the plain math, the activations quantized per block of 32 as the
  kernels quantize them times the dequantized weight, within float32 rounding, and the
  unquantized product within the activations' rounding (the bounds of test_kernels.py);
- each row of a batch is the lone row bit for bit, on both builds;
- a token table in these blocks looks up exactly the dequantized rows.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from glassformer.accel import QuantizedLinear, kquants, ops
from glassformer.accel import weight_formats as quant
from glassformer.accel.quantized_embedding import QuantizedEmbedding

U = 2.0**-24
TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q5_0", "Q5_1"]
FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q5_0": (0,), "Q5_1": (0, 2)}
# (M, N, K): one row and several, whole tiles of 4 rows and a rest, past a panel of 64 rows;
# K-quants take whole super-blocks of 256, Q5_x blocks of 32 (odd and short groups of 8)
SHAPES = {"K": [(1, 1, 256), (1, 13, 512), (3, 7, 768), (9, 20, 256), (70, 5, 512)],
          "5": [(1, 1, 32), (1, 13, 96), (2, 7, 288), (9, 20, 576), (70, 5, 320)]}


def random_blocks(name: str, n: int, k: int, seed: int, scale: float = 0.01) -> np.ndarray:
    """(n, row bytes) uint8: n rows of random `name` blocks whose fp16 fields are random
    finite values of about `scale`, the signs mixed (Q4_K's dmin and Q5_1's m as well)."""
    qtype = gguf.GGMLQuantizationType[name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[name]:
        values = (rng.standard_normal((n, k // block)) * scale).astype(np.float16)
        raw[..., at:at + 2] = values.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def layer(name, n, k, seed, bias=None, backend="auto"):
    raw = random_blocks(name, n, k, seed)
    return QuantizedLinear.from_gguf(raw, gguf.GGMLQuantizationType[name], (n, k), bias, backend), raw


def shapes(name):
    return SHAPES["K" if name.endswith("_K") else "5"]


def float_bound(x, w):
    return 2 * (x.shape[1] + 2) * U * (x.abs() @ w.abs().T) + 1e-30


def activation_bound(x, w):
    _, dx = quant.quantize_activations(x)  # (M, nb)
    wb = quant._blocks(w).abs().sum(-1)  # (N, nb)
    return (dx / 2) @ wb.T + 4 * float_bound(x, w)


def check_within(y, ref, bound):
    assert torch.all((y - ref).abs() <= bound), (y - ref).abs().sub(bound).max()


def product(build, x, compact):
    """x (M, K) times the layer's blocks by one build of the kernels (native or AVX2)."""
    fmt = build.WeightFormat.__members__[compact.mode.value]
    return build.linear_gguf(x.contiguous(), compact.qweight, fmt, compact.bias)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("name", TYPES)
def test_weights_are_gguf_s_bit_for_bit(name, kernels, avx2_kernels):
    k = shapes(name)[-1][2]
    compact, raw = layer(name, 64, k, seed=1)  # zero quants, scales and minimums among them
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]))
    fmt = compact.mode
    assert fmt == kquants.BY_TYPE[name] and compact.qweight.shape == raw.shape  # the file's bytes
    assert same_bits(kquants.dequantize(compact.qweight, fmt, k), expected)
    for build in (kernels, avx2_kernels):
        assert same_bits(build.dequantize_gguf(compact.qweight, build.WeightFormat.__members__[fmt.value], k),
                         expected)
    assert same_bits(compact.dequantized_weight(), expected)


@pytest.mark.parametrize("name", TYPES)
def test_bits_per_weight_are_the_file_s(name):
    fmt = kquants.BY_TYPE[name]
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    assert kquants.bits_per_weight(fmt) == 8 * size / block
    compact, raw = layer(name, 3, block * 4, seed=2)
    assert compact.qweight.numel() == raw.size  # held: exactly the stored bytes


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_product_is_the_plain_math(name, with_bias, kernels):
    for i, (m, n, k) in enumerate(shapes(name)):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(m, k, generator=g)  # (M, K)
        b = torch.randn(n, generator=g) if with_bias else None
        compact, _ = layer(name, n, k, seed=i, bias=b)
        w = compact.dequantized_weight()  # (N, K)
        with torch.no_grad():
            y = compact(x)
        bias_term = 0 if b is None else 2 * U * b.abs()
        reference = kquants.linear(x, compact.qweight, compact.mode, b)  # rounded x times w
        check_within(y, reference, 4 * float_bound(x, w) + bias_term + 1e-6)
        check_within(y, F.linear(x, w, b), activation_bound(x, w) + bias_term)
        torch.testing.assert_close(ops.linear_gguf(x, compact.qweight, compact.mode, b, "torch"),
                                   reference, rtol=0, atol=0)


@pytest.mark.parametrize("name", TYPES)
def test_both_builds_compute_the_plain_math(name, kernels, avx2_kernels):
    """The AVX2 build (one block a step) and the native one (two a step where it targets
    AVX-512): the same exact integer sums, their float sums in their own orders."""
    for i, (m, n, k) in enumerate(shapes(name)):
        g = torch.Generator().manual_seed(10 + i)
        x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        compact, _ = layer(name, n, k, seed=10 + i, bias=b)
        w = compact.dequantized_weight()
        reference = kquants.linear(x, compact.qweight, compact.mode, b)
        bound = 4 * float_bound(x, w) + 2 * U * b.abs() + 1e-6
        for build in (kernels, avx2_kernels):
            check_within(product(build, x, compact), reference, bound)


@pytest.mark.parametrize("name", TYPES)
def test_each_row_is_the_lone_row_bit_for_bit(name, kernels, avx2_kernels):
    k = shapes(name)[2][2]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, k, generator=g) * 2  # (M_max, K)
    compact, _ = layer(name, 19, k, seed=3, bias=torch.randn(19, generator=g))
    for build in (kernels, avx2_kernels):
        alone = torch.cat([product(build, x[i:i + 1], compact) for i in range(len(x))])  # (M_max, N)
        for m in (2, 3, 4, 5, 8, 17, 64, 70):
            assert same_bits(product(build, x[:m], compact), alone[:m]), m
            assert same_bits(product(build, x[:m].flip(0), compact).flip(0), alone[:m]), m
    with torch.no_grad():  # the layer itself, whatever the number of rows
        assert same_bits(compact(x), torch.cat([compact(row[None]) for row in x]))


@pytest.mark.parametrize("name", TYPES)
def test_a_token_table_looks_up_the_dequantized_rows(name):
    k = shapes(name)[1][2]
    compact, raw = layer(name, 40, k, seed=4)
    table = QuantizedEmbedding(compact)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]))
    ids = torch.tensor([[5, 0, 39], [7, 7, 3]])
    assert same_bits(table(ids), expected[ids])
    assert table.qweight.data_ptr() == compact.qweight.data_ptr()  # shared, not copied


def test_gguf_formats_are_refused_where_nothing_can_make_them():
    with pytest.raises(ValueError, match="kept from GGUF files only"):
        QuantizedLinear.from_weight(torch.randn(4, 256), "q4_k")
    with pytest.raises(ValueError, match="whole blocks of 256"):
        QuantizedLinear.from_gguf(np.zeros(144, np.uint8), "Q4_K", (1, 288))
    with pytest.raises(ValueError, match="does not fit"):
        QuantizedLinear.from_gguf(np.zeros(143, np.uint8), "Q4_K", (1, 256))
    from glassformer.accel.quantize import QUANTIZE_CHOICES, quantize_format
    assert "q4_k" not in QUANTIZE_CHOICES
    with pytest.raises(ValueError, match="choose one of"):
        quantize_format("q4_k")


def test_gradients_flow_to_the_input():
    compact, _ = layer("Q4_K", 5, 256, seed=5, backend="torch")
    x = torch.randn(2, 256, requires_grad=True)
    compact(x).sum().backward()
    torch.testing.assert_close(x.grad, compact.dequantized_weight().sum(0).expand(2, 256))
