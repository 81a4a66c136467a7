"""The head fused with its cross-entropy against the oracle, F.cross_entropy on model(x)'s
logits: the same loss and the same gradient for every parameter, with ignored targets, tied and
untied heads (with a bias), a LoRA model's frozen head, chunks that split the rows unevenly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from glassformer.model.config import ModelConfig
from glassformer.model.transformer import Transformer
from glassformer.training.head_loss import (
    fused_head_applies,
    language_model_loss,
    linear_cross_entropy,
)
from glassformer.training.lora import LoRAConfig, add_lora
from glassformer.training.masking import IGNORE


def _model(tie: bool = True, bias: bool = False, lora: bool = False) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=37, context_length=16, d_model=24, n_layers=2, n_heads=4,
                         n_kv_heads=2, position="rope", norm="rmsnorm", gated=True,
                         activation="silu", tie_embeddings=tie, lm_head_bias=bias)
    model = Transformer(config)
    if lora:
        add_lora(model, LoRAConfig(4, 8.0))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:  # B starts at zero: let the adapter change the output
                    p.normal_(0, 0.1)
    if bias:
        with torch.no_grad():
            model.lm_head.bias.normal_(0, 0.5)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, 37, (3, 11), generator=generator)  # 33 rows
    y = torch.randint(0, 37, (3, 11), generator=generator)
    y[0, :4], y[2, 7] = IGNORE, IGNORE
    return x, y


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("tie, bias, lora", [(True, False, False), (False, True, False),
                                             (False, False, False), (True, False, True)])
def test_loss_and_gradients_match_cross_entropy_on_the_logits(tie, bias, lora, reduction):
    model = _model(tie, bias, lora)
    reference = copy.deepcopy(model)
    x, y = _batch()
    expected = F.cross_entropy(reference(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE,
                               reduction=reduction)
    (expected * 0.5).backward()  # a scaled loss, as under gradient accumulation
    h = model.forward_hidden(x)  # (3, 11, d)
    loss = linear_cross_entropy(h, model.lm_head.weight, model.lm_head.bias, y, reduction,
                                chunk_rows=7)  # 5 chunks, the last of 5 rows
    (loss * 0.5).backward()
    torch.testing.assert_close(loss, expected)
    ours, theirs = _grads(model), _grads(reference)
    assert [n for n, g in ours.items() if g is not None] == [n for n, g in theirs.items() if g is not None]
    for name, grad in theirs.items():
        if grad is not None:
            torch.testing.assert_close(ours[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    if lora:
        assert model.lm_head.weight.grad is None  # the frozen head gets no gradient


def test_the_objectives_take_the_fused_path_and_agree_with_the_logits():
    model = _model(tie=False, bias=True)
    x, y = _batch()
    assert fused_head_applies(model)
    fused = language_model_loss(model, x, y)
    seen = []
    with model.hooks.installed({"logits": lambda t, site: seen.append(t.shape)}):
        assert not fused_head_applies(model)  # a hook wants the logits: the plain path
        plain = language_model_loss(model, x, y)
    assert seen == [(3, 11, 37)]
    torch.testing.assert_close(fused, plain)


def test_without_a_gradient_nothing_is_kept():
    model = _model()
    x, y = _batch()
    with torch.no_grad():
        loss = linear_cross_entropy(model.forward_hidden(x), model.lm_head.weight, None, y, "sum",
                                    chunk_rows=4)
        expected = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, expected)


def test_no_counted_target_gives_zero_loss_and_zero_gradients():
    h = torch.randn(6, 5, requires_grad=True)
    weight = torch.randn(9, 5, requires_grad=True)
    loss = linear_cross_entropy(h, weight, None, torch.full((6,), IGNORE))
    loss.backward()
    assert loss.item() == 0.0
    assert not h.grad.any() and not weight.grad.any()


def test_a_second_backward_through_a_retained_graph_is_refused():
    h = torch.randn(6, 5, requires_grad=True)
    weight = torch.randn(9, 5, requires_grad=True)
    loss = linear_cross_entropy(h, weight, None, torch.randint(0, 9, (6,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()


def test_reduction_is_checked():
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(torch.randn(2, 3), torch.randn(4, 3), None, torch.zeros(2, dtype=torch.long),
                             "none")


@pytest.mark.parametrize("wrapper", ["compile", "ddp"])
def test_a_wrapped_model_still_takes_the_fused_head(wrapper, tmp_path, monkeypatch):
    """torch.compile's wrapper and DistributedDataParallel call the model's forward only: the
    loss goes through it for the final hidden state and still never builds the logits; the loss
    and every gradient are the plain model's."""
    import torch.distributed as dist

    from glassformer.training import head_loss

    model, plain = _model(tie=False, bias=True), _model(tie=False, bias=True)
    x, y = _batch()
    fused_calls = []
    fused = head_loss.linear_cross_entropy

    def counted(*args, **kwargs):
        fused_calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(head_loss, "linear_cross_entropy", counted)
    if wrapper == "ddp":
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = (torch.compile(model, backend="eager") if wrapper == "compile"
                   else torch.nn.parallel.DistributedDataParallel(model))
        assert fused_head_applies(wrapped)
        loss = language_model_loss(wrapped, x, y)
        loss.backward()
    finally:
        if wrapper == "ddp":
            dist.destroy_process_group()
    expected = F.cross_entropy(plain(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
    expected.backward()
    assert fused_calls == [1]
    torch.testing.assert_close(loss, expected)
    for (name, got), want in zip(_grads(model).items(), _grads(plain).values(), strict=True):
        torch.testing.assert_close(got, want, msg=name)


def test_a_soft_capped_head_takes_the_logits():
    """Gemma 2's final soft-cap sits after the product: the loss is the capped logits'."""
    torch.manual_seed(0)
    model = Transformer(_model().config.replace(final_softcap=0.5))
    ids = torch.randint(0, 37, (2, 9))
    targets = torch.randint(0, 37, (2, 9))
    assert not fused_head_applies(model)
    expected = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    assert float(model(ids).detach().abs().max()) <= 0.5
    torch.testing.assert_close(language_model_loss(model, ids, targets), expected)
