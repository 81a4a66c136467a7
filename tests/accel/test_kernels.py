"""The matrix-vector kernels against the plain PyTorch products they stand for.

Tolerances are bounds, not guesses: float32 dot products of length K differ from any other
summation order by at most about K·u·(|x| @ |W|^T) (u = 2^-24), and quantizing the
activations to int8 per block of 32 moves each x_k by at most d_b / 2 (d_b = amax_b / 127),
so the product moves by at most sum_b d_b / 2 · sum_{k in b} |W_nk|.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glassformer.accel import QuantizedLinear, build, ops
from glassformer.accel import kernels as accel_kernels
from glassformer.accel import weight_formats as quant
from glassformer.accel.tile_order import to_tile_order

U = 2.0**-24
# (M, N, K): one row and several; N and K not multiples of 4, 8 or 32 included
# and many rows: whole register tiles and a rest, past one panel of rows per weight pass
SHAPES = [(1, 1, 1), (1, 13, 37), (2, 7, 100), (3, 64, 576), (8, 9, 33), (1, 960, 576),
          (5, 130, 1536), (1, 4, 31), (2, 11, 272), (1, 6, 150), (17, 19, 96), (70, 21, 300)]
MODES = ["fp32", "bf16", "int8", "int4"]


def make(shape, seed, with_bias):
    m, n, k = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)  # (M, K)
    w = torch.randn(n, k, generator=g) / k**0.5  # (N, K)
    b = torch.randn(n, generator=g) if with_bias else None
    return x, w, b


def quantized(w, mode):
    """The tensors each kernel takes, and the float32 weight they stand for."""
    k = w.shape[1]
    if mode == "fp32":
        return (w,), w
    if mode == "bf16":
        wb = w.to(torch.bfloat16)
        return (wb,), wb.float()
    if mode == "int8":
        q, d = quant.quantize_int8(w)
        return (q, d), quant.dequantize_int8(q, d, k)
    q, d, m = quant.quantize_int4(w)
    return (q, d, m), quant.dequantize_int4(q, d, m, k)


KERNELS = {"fp32": ops.linear_fp32, "bf16": ops.linear_bf16, "int8": ops.linear_int8,
           "int4": ops.linear_int4}


def float_bound(x, w):
    """(M, N) bound on the float32 rounding of x @ w^T in any summation order."""
    return 2 * (x.shape[1] + 2) * U * (x.abs() @ w.abs().T) + 1e-30


def activation_bound(x, w):
    """(M, N) bound on |x_q @ w^T - x @ w^T| for x quantized per block of 32."""
    _, dx = quant.quantize_activations(x)  # (M, nb)
    wb = quant._blocks(w).abs().sum(-1)  # (N, nb)
    return (dx / 2) @ wb.T + 4 * float_bound(x, w)


def check_within(y, ref, bound):
    torch.testing.assert_close(y, ref, rtol=0, atol=bound.max().item())
    assert torch.all((y - ref).abs() <= bound), (y - ref).abs().sub(bound).max()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_kernel_matches_dequantized_product(request, mode, shape, with_bias, backend):
    if backend == "cpp":
        request.getfixturevalue("kernels")
    x, w, b = make(shape, seed=SHAPES.index(shape) * 4 + MODES.index(mode), with_bias=with_bias)
    tensors, w_float = quantized(w, mode)
    y = KERNELS[mode](x, *tensors, b, backend=backend)
    ref = F.linear(x, w_float, b)
    exact = mode in ("fp32", "bf16")
    bound = float_bound(x, w_float) if exact else activation_bound(x, w_float)
    check_within(y, ref, bound + (0 if b is None else 2 * U * b.abs()))


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("shape", SHAPES)
def test_cpp_and_torch_quantize_activations_alike(kernels, mode, shape):
    x, w, b = make(shape, seed=7, with_bias=True)
    tensors, w_float = quantized(w, mode)
    y = KERNELS[mode](x, *tensors, b, backend="cpp")
    y_torch = KERNELS[mode](x, *tensors, b, backend="torch")
    # same integer products; only the order of the float sums differs
    check_within(y, y_torch, 4 * float_bound(x, w_float) + 2 * U * b.abs() + 1e-6)


FUNCTIONS = {"fp32": "linear_f32", "bf16": "linear_bf16", "int8": "linear_q8", "int4": "linear_q4"}


@pytest.mark.parametrize("mode", MODES)
def test_avx2_build_matches_the_dequantized_product(avx2_kernels, mode):
    """The AVX2-only build, whose quantized kernels differ from the AVX-512 VNNI ones."""
    for shape in SHAPES:
        x, w, b = make(shape, seed=SHAPES.index(shape), with_bias=True)
        tensors, w_float = quantized(w, mode)
        exact = mode in ("fp32", "bf16")
        units = (4, 1, 1)  # the int kernels read tile order
        held = tensors if exact else [to_tile_order(t, u) for t, u in zip(tensors, units, strict=False)]
        y = getattr(avx2_kernels, FUNCTIONS[mode])(x, *held, b)
        bound = float_bound(x, w_float) if exact else activation_bound(x, w_float)
        check_within(y, F.linear(x, w_float, b), bound + 2 * U * b.abs())
        y_torch = KERNELS[mode](x, *tensors, b, backend="torch")
        check_within(y, y_torch, 4 * float_bound(x, w_float) + 2 * U * b.abs() + 1e-6)
    if not exact:
        q, d, *mins = quantized(torch.randn(9, 100), mode)[0]
        mins = mins[0] if mins else None
        expected = ops.dequantize(q, d, mins, 100, "torch")
        assert torch.equal(avx2_kernels.dequantize(q, d, mins, 100), expected)


def test_large_batches_compute_the_layers_own_function(kernels):
    """Float layers: the float32 product with the stored weight (activations never rounded);
    int layers: the kernels' quantized activations, as the PyTorch reference computes them."""
    x, w, b = make((20, 70, 64), seed=3, with_bias=True)
    for mode in MODES:
        tensors, w_float = quantized(w, mode)
        y = KERNELS[mode](x, *tensors, b, backend="cpp")
        if mode in ("fp32", "bf16"):
            check_within(y, F.linear(x, w_float, b), float_bound(x, w_float) + 1e-6)
        else:
            torch.testing.assert_close(y, KERNELS[mode](x, *tensors, b, backend="torch"))


def test_int8_weight_error_is_bounded():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 100, generator=g)
    q, d = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (quant.dequantize_int8(q, d, 100) - w).abs()
    step = d.float().repeat_interleave(32, dim=1)[:, :100]  # (N, K) block scale per element
    assert torch.all(err <= step * 0.5001)
    assert (err.norm() / w.norm()).item() < 0.01


def test_int4_weight_error_is_bounded():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 100, generator=g) + 0.3
    q, d, m = quant.quantize_int4(w)
    err = (quant.dequantize_int4(q, d, m, 100) - w).abs()
    step = d.float().repeat_interleave(32, dim=1)[:, :100]
    assert torch.all(err <= step * 0.51)
    assert (err.norm() / w.norm()).item() < 0.12


def test_nibbles_round_trip():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (3, 2, 32), generator=g, dtype=torch.uint8)
    packed = quant.pack_nibbles(q)
    assert packed.shape == (3, 32)
    assert torch.equal(packed[0, 0] & 0x0F, q[0, 0, 0]) and torch.equal(packed[0, 0] >> 4, q[0, 0, 16])
    assert torch.equal(quant.unpack_nibbles(packed), q)


def test_activation_quantization_is_within_half_a_step():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 70, generator=g) * torch.tensor([1.0, 1e-3, 0.0]).unsqueeze(1)
    q, d = quant.quantize_activations(x)
    assert q.abs().max() <= 127 and torch.equal(q, q.round())
    back = (q * d.unsqueeze(-1)).reshape(3, -1)[:, :70]
    step = d.repeat_interleave(32, dim=1)[:, :70]
    assert torch.all((back - x).abs() <= step * 0.5001)
    assert torch.all(q[2] == 0)


@pytest.mark.parametrize("mode", MODES)
def test_quantized_linear_any_leading_shape(mode):
    g = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(40, 24)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(24, 40, generator=g))
    layer = QuantizedLinear.from_linear(linear, mode)
    x = torch.randn(2, 3, 40, generator=g)  # 6 rows: the kernel path
    with torch.no_grad():
        y = layer(x)
    assert y.shape == (2, 3, 24)
    w = layer.dequantized_weight()
    ref = F.linear(x, w, linear.bias.detach())
    x2 = x.reshape(-1, 40)
    bound = float_bound(x2, w) if mode in ("fp32", "bf16") else activation_bound(x2, w)
    check_within(y.reshape(-1, 24), ref.reshape(-1, 24), bound + 1e-6)
    with torch.no_grad():  # 24 rows: the same function as 6
        torch.testing.assert_close(layer(x.repeat(2, 2, 1)), y.repeat(2, 2, 1))


def test_quantized_linear_state_dict_round_trip():
    layer = QuantizedLinear.from_weight(torch.randn(8, 64), "int4", bias=torch.randn(8))
    state = layer.state_dict()
    assert set(state) == {"qweight", "scales", "mins", "bias"}
    tensors = {k: v for k, v in state.items() if k != "bias"}
    again = QuantizedLinear(64, 8, "int4", tensors, state["bias"])
    x = torch.randn(1, 64)
    assert torch.equal(again(x), layer(x))


def test_quantized_linear_rejects_bad_input():
    with pytest.raises(ValueError, match="mode"):
        QuantizedLinear.from_weight(torch.randn(4, 8), "int3")
    layer = QuantizedLinear.from_weight(torch.randn(4, 8), "int8")
    with pytest.raises(ValueError, match="8 input features"):
        layer(torch.randn(1, 9))
    with pytest.raises(ValueError, match="qweight"):
        QuantizedLinear(8, 4, "int8", {"qweight": torch.zeros(4, 8, dtype=torch.int8)})


def test_environment_variable_forces_the_torch_path(monkeypatch):
    monkeypatch.setenv("GLASSFORMER_KERNELS", "torch")
    build.reset()
    try:
        assert accel_kernels.extension() is None
        with pytest.raises(RuntimeError, match="not available"):
            ops.linear_fp32(torch.randn(1, 8), torch.randn(4, 8), backend="cpp")
        layer = QuantizedLinear.from_weight(torch.randn(4, 64), "int8")
        x = torch.randn(1, 64)
        torch.testing.assert_close(layer(x), ops.linear_int8(x, layer.qweight, layer.scales,
                                                             backend="torch"))
    finally:
        monkeypatch.delenv("GLASSFORMER_KERNELS")
        build.reset()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_dequantize_exactly_as_gguf(qtype):
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(6)
    w = (torch.randn(12, 96, generator=g) * 0.1).numpy()
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, kind)  # (12, bytes per row) uint8
    layer = QuantizedLinear.from_gguf(raw, kind, (12, 96))
    assert layer.mode == ("int8" if qtype == "Q8_0" else "int4")
    expected = torch.from_numpy(gguf.quants.dequantize(raw, kind))
    assert torch.equal(layer.dequantized_weight(), expected)
    x = torch.randn(2, 96, generator=g)
    w_float = layer.dequantized_weight()
    check_within(layer(x), F.linear(x, w_float), activation_bound(x, w_float))


def test_gguf_blocks_reject_unsupported_input():
    with pytest.raises(ValueError, match="Q6_K"):
        QuantizedLinear.from_gguf(torch.zeros(10).numpy(), "Q6_K", (1, 32))
    with pytest.raises(ValueError, match="does not fit"):
        QuantizedLinear.from_gguf(torch.zeros(33, dtype=torch.uint8).numpy(), "Q8_0", (1, 32))


def test_without_a_compiler_the_torch_path_is_used(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("GLASSFORMER_HOME", str(tmp_path))  # no cached build there
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    build.reset()
    try:
        assert accel_kernels.extension() is None
        assert "no C++ compiler" in capsys.readouterr().err
        layer = QuantizedLinear.from_weight(torch.randn(5, 40), "int4")
        x = torch.randn(2, 40)
        torch.testing.assert_close(
            layer(x), ops.linear_int4(x, layer.qweight, layer.scales, layer.mins, backend="torch")
        )
    finally:
        monkeypatch.undo()
        build.reset()


@pytest.mark.parametrize("k", [31, 64, 100, 576])
def test_cpp_dequantize_equals_the_torch_one(kernels, k):
    w = torch.randn(9, k, generator=torch.Generator().manual_seed(k))
    q, d = quant.quantize_int8(w)
    assert torch.equal(ops.dequantize(q, d, None, k, "cpp"), quant.dequantize_int8(q, d, k))
    q, d, m = quant.quantize_int4(w)
    assert torch.equal(ops.dequantize(q, d, m, k, "cpp"), quant.dequantize_int4(q, d, m, k))


def test_the_compiled_row_tile_is_the_python_one(kernels):
    w = torch.randn(5, 16)
    x = torch.randn(ops.ROW_TILE + 1, 16)
    torch.testing.assert_close(kernels.try_f32(x[: ops.ROW_TILE], w, None), x[: ops.ROW_TILE] @ w.T)
    assert kernels.try_f32(x, w, None) is None  # one row more than a tile: the caller's path


def test_loading_a_state_dict_updates_a_used_layer():
    g = torch.Generator().manual_seed(8)
    source = QuantizedLinear.from_weight(torch.randn(6, 64, generator=g), "int8")
    target = QuantizedLinear.from_weight(torch.randn(6, 64, generator=g), "int8")
    x = torch.randn(1, 64, generator=g)
    target(x)  # resolves the fast path with the old tensors
    target.load_state_dict(source.state_dict())
    assert torch.equal(target(x), source(x))


def test_gradients_flow_to_the_input_through_the_torch_path():
    w = torch.randn(5, 40, generator=torch.Generator().manual_seed(9))
    layer = QuantizedLinear.from_weight(w, "int4")
    x = torch.randn(2, 40, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.dequantized_weight().sum(0).expand(2, 40))
