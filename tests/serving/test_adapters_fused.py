"""Served adapters on the fused decode step, called directly: every product updated, against
the base model with the adapter merged into its weights (W + scale·B A, the oracle); each
adapter row the same whatever rows share its step and however many threads compute it."""

from __future__ import annotations

import copy

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.accel.fast_decode import fused_adapter
from glassformer.accel.quantize import quantize_model

pytestmark = pytest.mark.usefixtures("kernels")


def factors(config, rank: int, seed: int) -> dict:
    """Random LoRA factors on every product of every layer, each output split into targets as
    the served adapters split them: (layer, path) -> (A stacked (n r, d_in), [(start, B)])."""
    g = torch.Generator().manual_seed(seed)
    q, kv, ff = config.n_heads * config.head_dim, config.kv_heads * config.head_dim, config.ff_dim
    splits = {"attn.qkv": (config.d_model, [q, kv, kv]), "attn.out": (q, [config.d_model]),
              "mlp.up": (config.d_model, [ff, ff]), "mlp.down": (ff, [config.d_model])}
    updates = {}
    for i in range(config.n_layers):
        for path, (width, outs) in splits.items():
            a = torch.randn(len(outs) * rank, width, generator=g) * 0.3  # (n r, d_in)
            starts = [sum(outs[:j]) for j in range(len(outs))]
            updates[(i, path)] = (a, [(s, torch.randn(o, rank, generator=g) * 0.3)
                                      for s, o in zip(starts, outs, strict=True)])
    return updates


def merged(model: Transformer, updates: dict) -> Transformer:
    """`model` with each update added to its weights: W[s:s+o] += B_j A_j."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for (i, path), (a, ups) in updates.items():
            weight = model.blocks[i].get_submodule(path).weight  # (d_out, d_in)
            rank = a.shape[0] // len(ups)
            for j, (start, b) in enumerate(ups):
                weight[start : start + b.shape[0]] += b @ a[j * rank : (j + 1) * rank]
    return model


def test_adapter_rows_equal_the_merged_model_alone_and_at_any_thread_count():
    # widths that are no multiple of 8 (36, 12, 52, 104): every kernel's remainder is taken
    config = get_preset("tiny-llama").replace(d_model=36, n_heads=3, n_kv_heads=1, d_ff=52)
    model = Transformer(config).eval()
    first, second = factors(config, 3, 1), factors(config, 3, 2)
    with torch.no_grad():  # the fused step is built for inference only
        steps = {name: quantize_model(copy.deepcopy(m), "none").fused_step() for name, m in
                 {"base": model, "a": merged(model, first), "b": merged(model, second)}.items()}
    adapters = [fused_adapter(config.n_layers, first), fused_adapter(config.n_layers, second)]
    B, g = 9, torch.Generator().manual_seed(3)
    x = torch.randn(B, config.d_model, generator=g)  # (B, d)
    positions, slots = torch.zeros(B, dtype=torch.long), torch.arange(B)[:, None]  # (B,), (B, 1)
    cos, sin = torch.ones(B, config.head_dim), torch.zeros(B, config.head_dim)  # (B, d_head)
    of = torch.tensor([0, 0, -1, 0, 1, 0, 0, 1, 0])  # 6 rows on the first: 4 together, then 2

    def rows(step, index=None, b=slice(None)):
        keys = [torch.zeros(B, config.kv_heads, config.head_dim) for _ in range(config.n_layers)]
        values = [torch.zeros_like(k) for k in keys]
        return step.rows(x[b], positions[b], slots[b], ((cos[b], sin[b]),), keys, values,
                         None if index is None else index[b], adapters)

    threads = torch.get_num_threads()
    with torch.no_grad():
        try:
            torch.set_num_threads(1)
            one = rows(steps["base"], of)
            torch.set_num_threads(2)
            two = rows(steps["base"], of)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, two)
        for name, index in {"base": -1, "a": 0, "b": 1}.items():
            chosen = (of == index).nonzero()[:, 0]
            torch.testing.assert_close(two[chosen], rows(steps[name])[chosen], atol=1e-4, rtol=1e-4)
        for b in range(B):  # each row alone: bitwise as in the full step
            assert torch.equal(rows(steps["base"], of, slice(b, b + 1))[0], two[b])
