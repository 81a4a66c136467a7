"""Muon's Newton–Schulz iterations in C++ (csrc/newton_schulz.cpp) against the iteration
written out in float64, and the optimizer's use of them."""

import pytest
import torch

from glassformer.accel import kernels as accel_kernels
from glassformer.training import optim

MUON = (3.4445, -4.7750, 2.0315)


def plain_iterations(stack: torch.Tensor, steps: int) -> torch.Tensor:
    """X <- a X + (b A + c A²) X, A = X Xᵀ, in float64."""
    a, b, c = MUON
    x = stack.double()
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def unit_stack(shape, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=(-2, -1), keepdim=True)


# (n, short, long): by the Gram matrix where long >= 2 short, directly otherwise
@pytest.mark.parametrize("shape", [(3, 8, 24), (2, 16, 40), (2, 8, 8), (1, 6, 11)])
@pytest.mark.parametrize("steps", [0, 1, 5])
def test_kernel_iterations_equal_the_plain_ones(kernels, shape, steps):
    x = unit_stack(shape, sum(shape) + steps)
    got = kernels.newton_schulz(x, *MUON, steps)
    assert got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), plain_iterations(x, steps), rtol=0, atol=2e-5)


def test_kernel_refuses_a_tall_or_non_float32_stack(kernels):
    with pytest.raises(RuntimeError, match="short, long"):
        kernels.newton_schulz(torch.zeros(1, 8, 4), *MUON, 5)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.newton_schulz(torch.zeros(1, 4, 8, dtype=torch.float64), *MUON, 5)


@pytest.mark.parametrize("shape", [(4, 24, 8), (4, 8, 8), (2, 8, 20)])
def test_orthogonalize_runs_the_kernel_in_float32_and_agrees_with_pytorch(
        kernels, monkeypatch, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    calls = []
    monkeypatch.setattr(accel_kernels, "newton_schulz",
                        lambda *a: calls.append(1) or kernels.newton_schulz(*a))
    with_kernel = optim.orthogonalize(x, MUON, 5, 1e-7, torch.float32)
    assert calls == [1]
    monkeypatch.setattr(accel_kernels, "available", lambda: False)
    without = optim.orthogonalize(x, MUON, 5, 1e-7, torch.float32)
    assert with_kernel.shape == x.shape
    torch.testing.assert_close(with_kernel, without, rtol=0, atol=1e-6)
    optim.orthogonalize(x, MUON, 5, 1e-7, torch.bfloat16)  # bfloat16 stays with PyTorch
    assert calls == [1]


def _muon_run(shapes, steps=3, **options):
    """StackedMuon's parameters and momentum buffers after `steps` steps on seeded gradients."""
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]
    opt = optim.StackedMuon(params, lr=0.03, weight_decay=0.1, ns_dtype=torch.float32, **options)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params + [opt.state[p]["momentum_buffer"] for p in params]


# tall, wide and square; by the Gram matrix (long >= 2 short) and directly
SHAPES = [(48, 16), (16, 16), (16, 40), (12, 20), (7, 3), (40, 16)]


@pytest.mark.parametrize("options", [{}, {"nesterov": False, "adjust_lr_fn": "match_rms_adamw"}])
def test_muon_update_is_the_pytorch_step(kernels, monkeypatch, options):
    ours = _muon_run(SHAPES, **options)  # through kernels.muon_update
    monkeypatch.setattr(optim.StackedMuon, "_in_kernels", lambda self, params: False)
    theirs = _muon_run(SHAPES, **options)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_muon_step_takes_the_kernel_for_float32_only(kernels, monkeypatch):
    calls = []
    monkeypatch.setattr(accel_kernels, "muon_update",
                        lambda *a: calls.append(1) or kernels.muon_update(*a))
    for dtype, expected in ((torch.float32, [1]), (torch.bfloat16, [])):
        calls.clear()
        p = torch.nn.Parameter(torch.randn(8, 24))
        p.grad = torch.randn(8, 24)
        optim.StackedMuon([p], lr=0.01, ns_dtype=dtype).step()
        assert calls == expected


def test_muon_update_refuses_mismatched_lists(kernels):
    p, g, b = torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="one gradient, buffer and rate"):
        kernels.muon_update([p], [g], [], [0.1], 0.95, True, *MUON, 5, 1e-7, 1.0)
    with pytest.raises(RuntimeError, match="float32 CPU matrices"):
        kernels.muon_update([p], [torch.zeros(8, 4)], [b], [0.1], 0.95, True, *MUON, 5, 1e-7, 1.0)
