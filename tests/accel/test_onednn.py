"""Training products through oneDNN equal the plain ones (values and gradients, against a
float64 oracle), and apply only where they should."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glassformer.accel import onednn
from glassformer.accel.fast_training import use_fast_training
from glassformer.model.config import ModelConfig
from glassformer.model.transformer import Transformer

needs_onednn = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
    reason="this PyTorch has no oneDNN linear",
)


def values_and_grads(fn, inputs, grad_out):
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*leaves)
    y.backward(grad_out.to(y.dtype))
    return y.detach(), [None if t is None else t.grad for t in leaves]


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("lead", "k", "n"), [((3, 17), 24, 40), ((50,), 40, 24), ((2, 5, 7), 9, 9),
                                              ((4, 64), 128, 65)])
def test_linear_values_and_gradients(lead, k, n, bias):
    g = torch.Generator().manual_seed(k * n)
    x = torch.randn(*lead, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    grad_out = torch.randn(*lead, n, generator=g, dtype=torch.float64)
    y, grads = values_and_grads(onednn._Linear.apply, [x, w, b], grad_out.float())
    y64, grads64 = values_and_grads(F.linear, [t if t is None else t.double() for t in (x, w, b)],
                                    grad_out)
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, grads64, strict=True):
        if ref is not None:
            assert got.shape == ref.shape and got.is_contiguous()
            torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_linear_takes_a_strided_input():
    x = torch.randn(6, 5, 16).transpose(0, 1)  # (5, 6, 16), not contiguous
    w = torch.randn(12, 16)
    grad_out = torch.randn(5, 6, 12, dtype=torch.float64)
    y, (dx, dw) = values_and_grads(lambda x, w: onednn._Linear.apply(x, w, None), [x, w],
                                   grad_out.float())
    y64, (dx64, dw64) = values_and_grads(F.linear, [x.double(), w.double()], grad_out)
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw.double(), dw64, rtol=1e-4, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("n", [40, 8])  # weight taller than wide, and not
def test_linear_takes_a_broadcast_gradient(n):
    x, w = torch.randn(3, 10, 16), torch.randn(n, 16)
    _, (dx, dw) = values_and_grads(lambda x, w: onednn._Linear.apply(x, w, None).sum(), [x, w],
                                   torch.tensor(1.0))  # the gradient reaches it with stride 0
    _, (dx64, dw64) = values_and_grads(lambda x, w: F.linear(x, w).sum(),
                                       [x.double(), w.double()], torch.tensor(1.0).double())
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw.double(), dw64, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_linear_applies_only_to_float32_cpu_training_products(monkeypatch):
    x, w = torch.randn(4, 8), torch.randn(3, 8, requires_grad=True)
    with torch.no_grad():
        assert onednn.linear(x, w) is None
    assert onednn.linear(x, w.detach()) is None  # nothing needs a gradient
    assert onednn.linear(x.bfloat16(), w.bfloat16()) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's bfloat16 product instead
        assert onednn.linear(x, w) is None
    assert onednn.linear(x, w) is not None
    monkeypatch.setattr(onednn, "available", lambda: False)  # a PyTorch without it
    assert onednn.linear(x, w) is None


@needs_onednn
def test_training_step_gradients_equal_the_plain_path(monkeypatch):
    config = ModelConfig(vocab_size=50, context_length=16, d_model=48, n_layers=2, n_heads=4,
                         d_ff=96, mlp_bias=True, attn_bias=True)
    torch.manual_seed(0)
    plain = Transformer(config)
    model = Transformer(config)
    model.load_state_dict(plain.state_dict())
    calls = []
    real = onednn._Linear.apply
    monkeypatch.setattr(onednn._Linear, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr("glassformer.accel.fast_training.onednn_pays", lambda: True)
    use_fast_training(model)
    layers = model.linear_layers().values()
    assert all(isinstance(layer, onednn.OneDNNLinear) for layer in layers)
    assert model.lm_head.weight is model.embed.tokens.weight  # still tied
    ids = torch.randint(0, 50, (3, 17))

    def loss_and_grads(model):
        model.zero_grad()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 50), ids[:, 1:].reshape(-1))
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = loss_and_grads(model)
    assert len(calls) == 2 * config.n_layers * 2 + 1  # qkv, out, up, down per layer; the head
    loss_plain, grads_plain = loss_and_grads(plain)
    torch.testing.assert_close(loss, loss_plain)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_plain[name], rtol=1e-4, atol=1e-6, msg=name)
