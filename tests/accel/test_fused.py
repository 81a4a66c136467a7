"""The fused RMSNorm, LayerNorm, RoPE, SwiGLU and GELU passes used in training equal the plain expressions:
values and gradients, against a float64 oracle, on odd sizes and strided inputs."""

from __future__ import annotations

import pytest
import torch

from glassformer.accel import fused
from glassformer.accel.fast_training import use_fast_training
from glassformer.model.config import ModelConfig
from glassformer.model.layers.positions import rope_cos_sin
from glassformer.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("kernels")


def plain_rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def plain_rope(x, cos, sin):
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def values_and_grads(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*leaves)
    y.backward(grad_out.to(y.dtype))
    return y.detach(), [t.grad for t in leaves]


def assert_matches_oracle(fused_fn, plain_fn, inputs, constants=()):
    g = torch.Generator().manual_seed(1)
    y64 = plain_fn(*[t.double() for t in inputs], *[c.double() for c in constants])
    grad_out = torch.randn(y64.shape, generator=g, dtype=torch.float64)
    y, grads = values_and_grads(lambda *t: fused_fn(*t, *constants), inputs, grad_out.float())
    y_ref, grads_ref = values_and_grads(
        lambda *t: plain_fn(*t, *[c.double() for c in constants]), [t.double() for t in inputs],
        grad_out)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(2, 7, 16), (3, 5, 37), (1, 1, 128), (64, 130)])
def test_rms_norm_values_and_gradients(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    calls = []

    def fused_norm(x, w):
        y = fused.rms_norm(x, w, 1e-5)
        calls.append(y is not None)
        return y

    assert_matches_oracle(fused_norm, lambda x, w: plain_rms_norm(x, w, 1e-5), [x, w])
    assert calls == [True]


def test_rms_norm_takes_strided_input():
    x = torch.randn(6, 5, 24).transpose(0, 1)  # (5, 6, 24), not contiguous
    w = torch.randn(24)
    assert_matches_oracle(lambda x, w: fused.rms_norm(x, w, 1e-6),
                          lambda x, w: plain_rms_norm(x, w, 1e-6), [x, w])


def plain_layer_norm(x, w, b, eps):
    centred = x - x.mean(-1, keepdim=True)
    y = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * w
    return y if b is None else y + b


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 7, 16), (3, 5, 37), (1, 1, 128), (12, 64, 128)])
def test_layer_norm_values_and_gradients(shape, bias):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3 + 5  # an offset: the mean must come out exactly
    params = [torch.randn(shape[-1], generator=g) for _ in range(2 if bias else 1)]
    assert fused.layer_norm(x.requires_grad_(True), *params[:1], None, 1e-5) is not None

    def fused_norm(x, w, b=None):
        return fused.layer_norm(x, w, b, 1e-5)

    def reference(x, w, b=None):
        return plain_layer_norm(x, w, b, 1e-5)

    assert_matches_oracle(fused_norm, reference, [x.detach(), *params])


def test_layer_norm_takes_strided_input_and_gradient():
    x = torch.randn(6, 5, 24).transpose(0, 1)  # (5, 6, 24), not contiguous
    w, b = torch.randn(24), torch.randn(24)
    leaf = x.clone().requires_grad_(True)
    y = fused.layer_norm(leaf, w, b, 1e-6)
    grad = torch.randn(6, 5, 24).transpose(0, 1)  # a strided output gradient too
    y.backward(grad)
    ref_leaf = x.double().requires_grad_(True)
    ref = plain_layer_norm(ref_leaf, w.double(), b.double(), 1e-6)
    ref.backward(grad.double())
    torch.testing.assert_close(y.detach().double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("build", ["kernels", "avx2_kernels"])
def test_layer_norm_kernels_of_each_build(build, request):
    ext = request.getfixturevalue(build)
    g = torch.Generator().manual_seed(3)
    x, grad = torch.randn(70, 131, generator=g, dtype=torch.float64) * 2 + 1, torch.randn(
        70, 131, generator=g, dtype=torch.float64)
    w, b = torch.randn(131, generator=g, dtype=torch.float64), torch.randn(131, generator=g,
                                                                          dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y_ref = plain_layer_norm(*leaves, 1e-5)
    y_ref.backward(grad)
    ours = [t.float().requires_grad_(True) for t in (x, w, b)]
    y = ext.layer_norm(*ours, 1e-5)  # the autograd node: layer_norm_forward and _backward
    y.backward(grad.float())
    torch.testing.assert_close(y.detach().double(), y_ref.detach(), rtol=1e-5, atol=1e-5)
    for got, leaf in zip(ours, leaves, strict=True):
        torch.testing.assert_close(got.grad.double(), leaf.grad, rtol=1e-4, atol=1e-4)
    unbiased = ours[0].detach().requires_grad_(True)
    ext.layer_norm(unbiased, ours[1].detach(), None, 1e-5).backward(grad.float())
    torch.testing.assert_close(unbiased.grad, ours[0].grad)


@pytest.mark.parametrize("batch_angles", [1, 2])
@pytest.mark.parametrize("d_head", [8, 6, 64])
def test_rope_values_and_gradients_on_a_transposed_view(batch_angles, d_head):
    B, T, H = 2, 9, 3
    g = torch.Generator().manual_seed(d_head)
    x = torch.randn(B, T, H, d_head, generator=g).transpose(1, 2)  # (B, H, T, D): a view
    positions = torch.arange(T).repeat(batch_angles, 1) + torch.arange(batch_angles)[:, None] * 5
    inv_freq = 10000.0 ** -(torch.arange(0, d_head, 2).float() / d_head)  # (D/2,)
    cos, sin = rope_cos_sin(inv_freq, positions)  # (B or 1, 1, T, D)
    assert fused.rope(x.requires_grad_(True), cos, sin) is not None
    assert_matches_oracle(fused.rope, plain_rope, [x.detach()], constants=(cos, sin))


def plain_swiglu(h):
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("shape", [(2, 7, 2 * 37), (3, 64), (1, 1, 2 * 336)])
def test_swiglu_values_and_gradients(shape):
    h = torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1])) * 6
    assert fused.swiglu(h.clone().requires_grad_(True)) is not None
    assert_matches_oracle(fused.swiglu, plain_swiglu, [h])


@pytest.mark.parametrize("shape", [(2, 7, 37), (12, 64, 512), (1, 3)])
def test_gelu_values_and_gradients(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1])) * 4
    x.view(-1)[:3] = torch.tensor([0.0, -12.0, 12.0])[: x.numel()]  # the centre and the tails
    assert fused.gelu(x.clone().requires_grad_(True)) is not None
    assert_matches_oracle(fused.gelu, torch.nn.functional.gelu, [x])


@pytest.mark.parametrize("build", ["kernels", "avx2_kernels"])
def test_gelu_kernels_of_each_build_equal_the_exact_gelu(build, request):
    ext = request.getfixturevalue(build)
    # a dense grid (steps of 1e-4 on [-10, 10]; 200,001 points: a partial vector at the end),
    # each point as float32 holds it, so only the kernels' own error counts
    x = torch.linspace(-10, 10, 200_001, dtype=torch.float64).float().double()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    leaf = x.clone().requires_grad_(True)
    y = torch.nn.functional.gelu(leaf)
    y.sum().backward()
    slope = leaf.grad  # Φ(x) + x φ(x)
    ours = x.float().requires_grad_(True)
    y_kernel = ext.gelu(ours)  # the autograd node: gelu_forward and gelu_backward
    y_kernel.sum().backward()
    assert (y_kernel.detach().double() - y.detach()).abs().max() < 1e-6
    assert (ours.grad.double() - slope).abs().max() < 1e-6
    ours.grad = None
    ext.gelu(ours).backward(dy.float())
    torch.testing.assert_close(ours.grad.double(), dy * slope, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(768, 128), (13, 21), (8, 16), (9, 7), (1, 5), (65, 768)])
def test_transpose_tiles(kernels, shape):
    x = torch.randn(shape)
    assert torch.equal(kernels.transpose(x), x.t().contiguous())


def test_inference_and_other_dtypes_keep_the_plain_expressions():
    x, w = torch.randn(4, 8), torch.randn(8)
    assert fused.rms_norm(x, w, 1e-5) is None  # no gradient needed
    with torch.no_grad():
        assert fused.rms_norm(x.requires_grad_(True), w, 1e-5) is None
    xb = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    assert fused.rms_norm(xb, w.bfloat16(), 1e-5) is None


def test_training_step_gradients_equal_the_plain_path(monkeypatch):
    config = ModelConfig(vocab_size=50, context_length=16, d_model=48, n_layers=2, n_heads=4,
                         n_kv_heads=2, position="rope", norm="rmsnorm", activation="silu",
                         gated=True)
    torch.manual_seed(0)
    plain = Transformer(config)
    model = Transformer(config)
    model.load_state_dict(plain.state_dict())
    use_fast_training(model)
    assert model.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(0, 50, (3, 17))

    def loss_and_grads(model):
        model.zero_grad()
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), ids[:, 1:].reshape(-1))
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    calls = []
    for name in ("rms_norm", "rope", "swiglu"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, real=real, name=name:
                            calls.append(name) or real(*a))
    loss, grads = loss_and_grads(model)
    L = config.n_layers  # two norms and two rotations (q, k) per layer, one final norm
    assert sorted(calls) == sorted(["rms_norm"] * (2 * L + 1) + ["rope"] * 2 * L + ["swiglu"] * L)
    loss_plain, grads_plain = loss_and_grads(plain)
    torch.testing.assert_close(loss, loss_plain)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_plain[name], rtol=1e-4, atol=1e-6, msg=name)


def test_gelu_model_training_gradients_equal_the_plain_path(monkeypatch):
    config = ModelConfig(vocab_size=50, context_length=16, d_model=32, n_layers=2, n_heads=4,
                         position="learned", norm="layernorm", activation="gelu")
    torch.manual_seed(0)
    plain = Transformer(config)
    model = Transformer(config)
    model.load_state_dict(plain.state_dict())
    use_fast_training(model)
    ids = torch.randint(0, 50, (3, 17))
    calls = []
    for name in ("gelu", "layer_norm"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, real=real, name=name:
                            calls.append(name) or real(*a))
    grads = []
    for m in (model, plain):
        logits = m(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 50), ids[:, 1:].reshape(-1)).backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    L = config.n_layers  # two norms per layer and the final one, one activation per layer
    assert sorted(calls) == sorted(["gelu"] * L + ["layer_norm"] * (2 * L + 1))
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-4, atol=1e-6, msg=name)
