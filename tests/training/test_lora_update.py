"""LoRALinear's low-rank update (LowRankUpdate, its backward written out) against the plain
expression of its equation under autograd: the output and every gradient, with targets that
leave rows between them and a batch of sequences."""

from __future__ import annotations

import torch
from torch import nn

from glassformer.training.lora import LoRAConfig, LoRALinear


def test_update_and_gradients_equal_the_plain_expression():
    torch.manual_seed(0)
    base = nn.Linear(12, 20)
    slices = {"q": (0, 6), "v": (14, 20)}  # rows 6..14 belong to no target
    layer = LoRALinear(base, slices, LoRAConfig(3, 6.0))
    with torch.no_grad():
        for b in layer.lora_B.values():
            b.normal_()
    x = torch.randn(2, 5, 12, requires_grad=True)  # (B, T, d_in)
    weights = torch.randn(2, 5, 20)  # a loss that weighs every output differently

    (layer(x) * weights).sum().backward()
    ours = [x.grad, *(p.grad for p in (*layer.lora_A.values(), *layer.lora_B.values()))]
    assert base.weight.grad is None and base.bias.grad is None  # the base stays frozen

    leaves = [t.detach().clone().requires_grad_()
              for t in (x, *layer.lora_A.values(), *layer.lora_B.values())]
    xs, (a_q, a_v), (b_q, b_v) = leaves[0], leaves[1:3], leaves[3:]
    y = xs @ base.weight.t() + base.bias  # (B, T, d_out)
    update = torch.zeros_like(y)
    update[..., 0:6] = (xs @ a_q.t()) @ b_q.t()
    update[..., 14:20] = (xs @ a_v.t()) @ b_v.t()
    expected = y + 2.0 * update  # α / r = 6 / 3
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    (expected * weights).sum().backward()
    for got, leaf in zip(ours, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, atol=1e-5, rtol=1e-5)
