"""Training's C++ attention equals the reference attention in float64, values and the
gradients of q, k and v, in both builds; calls it does not take go to sdpa; a converted model
trains like the plain one."""

from __future__ import annotations

import math

import pytest
import torch

from glassformer.accel import attention as fast
from glassformer.accel import kernels as accel_kernels
from glassformer.accel.fast_training import use_fast_training
from glassformer.model.config import ModelConfig
from glassformer.model.layers.attention_backends import reference_attention, sdpa_attention
from glassformer.model.layers.masking import AttentionMask
from glassformer.model.transformer import Transformer


def plain_mask(B: int, T: int, causal: bool = True, **fields) -> AttentionMask:
    positions = torch.arange(T).expand(B, T)
    return AttentionMask(positions, positions, causal=causal, contiguous=True, **fields)


def qkv(B, H, KV, T, D, seed=0):
    """q, k, v as the Attention module makes them: strided views of one fused product."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(B, T, (H + 2 * KV) * D, generator=g)  # (B, T, (H + 2 KV) D)
    q, k, v = fused.split([H * D, KV * D, KV * D], dim=-1)
    return (q.view(B, T, H, D).transpose(1, 2), k.view(B, T, KV, D).transpose(1, 2),
            v.view(B, T, KV, D).transpose(1, 2))


def values_and_grads(kernel, q, k, v, mask, scale, grad_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = kernel(*leaves, mask, scale)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize(("B", "H", "KV", "T", "D"), [
    (2, 4, 4, 64, 32), (1, 2, 2, 7, 8), (3, 1, 1, 1, 16), (2, 4, 2, 100, 64), (1, 3, 1, 13, 24),
    (1, 6, 2, 150, 16), (1, 2, 1, 600, 8),  # blocks of 64 queries: 3 with groups of 3 heads; 10
])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("build", ["kernels", "avx2_kernels"])
def test_values_and_gradients_equal_the_reference(build, causal, B, H, KV, T, D, request,
                                                  monkeypatch):
    monkeypatch.setattr(accel_kernels, "extension", lambda: request.getfixturevalue(build))
    q, k, v = qkv(B, H, KV, T, D, seed=T + D)
    mask = plain_mask(B, T, causal)
    scale = 1 / math.sqrt(D) if causal else 0.5
    grad_out = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1),
                           dtype=torch.float64)
    calls = []

    def fused(q, k, v, mask, scale):
        calls.append(fast._applies(q, k, v, mask, 0.0))
        return fast.attention(q, k, v, mask, scale=scale)

    out, grads = values_and_grads(fused, q, k, v, mask, scale, grad_out.float())
    ref, ref_grads = values_and_grads(
        lambda *a: reference_attention(*a[:4], scale=a[4])[0],
        *(t.double() for t in (q, k, v)), mask, scale, grad_out)
    assert calls == [True]
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for got, want, name in zip(grads, ref_grads, "qkv", strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("case", ["padding", "window", "dropout", "no gradient", "odd head"])
def test_other_calls_go_to_sdpa(case):
    B, T, D = 2, 9, 8 if case != "odd head" else 12
    q, k, v = (t.detach().requires_grad_(case != "no gradient") for t in qkv(B, 2, 2, T, D))
    fields = {"padding": {"k_valid": torch.arange(T).expand(B, T) < 6},
              "window": {"window": 3}}.get(case, {})
    mask = plain_mask(B, T, **fields)
    dropout = 0.5 if case == "dropout" else 0.0
    assert not fast._applies(q, k, v, mask, dropout)
    torch.manual_seed(0)
    got = fast.attention(q, k, v, mask, dropout)
    torch.manual_seed(0)
    assert torch.equal(got, sdpa_attention(q, k, v, mask, dropout))


def test_a_converted_model_trains_like_the_plain_one():
    config = ModelConfig(vocab_size=50, context_length=16, d_model=32, n_layers=2, n_heads=4,
                         n_kv_heads=2, position="learned", norm="layernorm", activation="gelu")
    torch.manual_seed(0)
    plain = Transformer(config)
    model = Transformer(config)
    model.load_state_dict(plain.state_dict())
    use_fast_training(model)
    if not accel_kernels.available():
        pytest.skip("no C++ kernels here")
    assert model.blocks[0].attn.kernel is fast.attention
    ids = torch.randint(0, 50, (3, 17))
    grads = []
    for m in (model, plain):
        logits = m(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 50), ids[:, 1:].reshape(-1)).backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-4, atol=1e-6, msg=name)
