"""The layers are plain PyTorch: the C++ build starts only where `use_fast_training` (or
another accel conversion) is applied, never inside a forward; the conversion keeps the
model's parameters, state dict and tied weights."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import glassformer
from glassformer.accel import build, fused
from glassformer.accel import kernels as accel_kernels
from glassformer.accel.fast_training import use_fast_training
from glassformer.model.config import ModelConfig
from glassformer.model.transformer import Transformer

CONFIG = ModelConfig(vocab_size=50, context_length=16, d_model=48, n_layers=2, n_heads=4,
                     n_kv_heads=2, position="rope", norm="rmsnorm", activation="silu", gated=True)


def test_nothing_under_model_imports_accel():
    model_dir = Path(glassformer.__file__).parent / "model"
    for path in sorted(model_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            assert not any("accel" in name for name in names), f"{path} imports accel"


@pytest.fixture
def builds(monkeypatch):
    """Every start of a C++ build (or load of a cached one), recorded; the module loaded
    before is forgotten, and the next start gives it back."""
    calls, loaded = [], accel_kernels.extension()
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_load", lambda target: calls.append(target) or loaded)
    return calls


def train_step(model):
    ids = torch.randint(0, 50, (3, 17), generator=torch.Generator().manual_seed(0))
    loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, 50), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss


def test_a_plain_training_step_starts_no_build(builds, monkeypatch):
    monkeypatch.setattr("glassformer.accel.fast_training.onednn_pays", lambda: True)
    model = Transformer(CONFIG)
    train_step(model)
    with torch.no_grad():
        model.eval()(torch.zeros(1, 4, dtype=torch.long))
    assert builds == []


def test_the_conversion_builds_and_keeps_the_parameters(builds):
    model = Transformer(CONFIG)
    before = {name: p for name, p in model.named_parameters()}
    state = {name: t.clone() for name, t in model.state_dict().items()}
    use_fast_training(model)
    assert builds == ["native"]  # the build, here, once
    assert dict(model.named_parameters()) == before  # the very same Parameter objects
    assert model.state_dict().keys() == state.keys()
    assert model.lm_head.weight is model.embed.tokens.weight
    if accel_kernels.available():
        assert isinstance(model.blocks[0].norm1, fused.FusedRMSNorm)
        assert isinstance(model.blocks[0].attn.rotary, fused.FusedRotary)
        assert isinstance(model.blocks[0].mlp.activation, fused.FusedSwiGLU)
    train_step(model)
    assert builds == ["native"]


def test_no_build_for_a_model_the_kernels_do_not_serve(builds):
    model = Transformer(CONFIG).to(torch.bfloat16)
    use_fast_training(model)
    assert builds == []
    assert type(model.blocks[0].norm1).__name__ == "RMSNorm"


def test_the_converted_model_trains_like_the_plain_one():
    torch.manual_seed(0)
    plain = Transformer(CONFIG)
    model = Transformer(CONFIG)
    model.load_state_dict(plain.state_dict())
    use_fast_training(model)
    torch.testing.assert_close(train_step(model), train_step(plain), rtol=1e-5, atol=1e-6)
    grads = {name: p.grad for name, p in plain.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _gradients(seed: int, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(65, 128), (128,), (512, 128), (3,), (40_000,)]  # pieces of 16,384 and partial ones
    return [torch.randn(s, generator=g, dtype=torch.float64) * scale for s in shapes]


@pytest.mark.parametrize("build_name", ["kernels", "avx2_kernels"])
@pytest.mark.parametrize("scale", [1.0, 1e-4])  # clipped, and left as they are (coefficient 1)
def test_clip_grad_norm_equals_torchs(build_name, scale, request):
    ext = request.getfixturevalue(build_name)
    grads64 = _gradients(int(scale * 10) + 3, scale)
    reference = [g.clone() for g in grads64]
    params = [torch.zeros_like(g, requires_grad=True) for g in reference]
    for p, g in zip(params, reference, strict=True):
        p.grad = g
    total_ref = torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=True)
    grads = [g.float() for g in grads64]
    total = ext.clip_grad_norm(grads, 0.5)
    torch.testing.assert_close(total.double(), total_ref, rtol=1e-6, atol=0)
    for got, ref in zip(grads, reference, strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-12)


@pytest.mark.usefixtures("kernels")
def test_clip_grad_norm_takes_the_kernel_for_float32_and_torch_for_the_rest(monkeypatch):
    from glassformer.accel.fast_training import clip_grad_norm_

    calls = []
    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    for dtype, plain in ((torch.float32, False), (torch.float64, True)):
        params = [torch.zeros(s, dtype=dtype, requires_grad=True) for s in ((4, 8), (8,), (2,))]
        for p in params[:2]:
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
        # the third has no gradient: left out, as torch leaves it
        expected = torch.linalg.vector_norm(torch.cat([p.grad.double().flatten()
                                                       for p in params[:2]]))
        clipped = [p.grad.double() * min(1.0, 1.0 / (expected.item() + 1e-6)) for p in params[:2]]
        total = clip_grad_norm_(params, 1.0)
        torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=0)
        for p, ref in zip(params[:2], clipped, strict=True):
            torch.testing.assert_close(p.grad.double(), ref, rtol=1e-6, atol=1e-9)
        assert len(calls) == plain
        calls.clear()
