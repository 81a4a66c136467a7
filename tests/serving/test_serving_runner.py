"""The runner's fused decode steps against its per-layer path (the oracle, itself compared
with `generate` in test_engine.py)."""

import pytest
import torch

from glassformer.accel.fast_decode import FastDecoder
from glassformer.accel.quantize import quantize_model
from glassformer.serving import Engine, EngineConfig, RequestParams

pytestmark = pytest.mark.usefixtures("kernels")


def _events(model, todo, config, fused):
    """Every request's (token, logprob, top logprobs) per step, arrivals staggered."""
    engine = Engine(model, None, config)
    if not fused:
        engine.runner._fused = lambda: None
    handles, step = [], 0
    while len(handles) < len(todo) or engine.has_work():
        if step < len(todo):
            handles.append(engine.submit(*todo[step]))
        engine.step()
        step += 1
    assert engine.blocks.stats().used == 0
    return [[(e.token_id, e.logprobs) for e in h if e.token_id is not None] for h in handles]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-alibi"])
@pytest.mark.parametrize("mode", ["none", "int4"])
def test_fused_decode_steps_equal_the_per_layer_path(tiny, prompts, monkeypatch, name, mode):
    model = quantize_model(tiny(name), mode)
    rows = []
    original = FastDecoder.rows
    monkeypatch.setattr(FastDecoder, "rows",
                        lambda self, x, *a: rows.append(len(x)) or original(self, x, *a))
    params = RequestParams(max_new_tokens=10, eos_ids=(), logprobs=3)
    todo = [(p, params) for p in prompts([5, 17, 3, 30, 1, 9])]
    config = EngineConfig(block_size=4, n_blocks=96, token_budget=16, max_batch=6)
    fused = _events(model, todo, config, fused=True)
    assert rows and max(rows) > 1  # decode steps of several requests took the fused step
    expected = _events(model, todo, config, fused=False)
    for got, want in zip(fused, expected, strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, a), (_, b) in zip(got, want, strict=True):
            torch.testing.assert_close(a.logprob, b.logprob, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close([lp for _, lp in a.top], [lp for _, lp in b.top],
                                       atol=1e-4, rtol=1e-4)


def test_other_pools_and_reference_attention_keep_the_per_layer_path(tiny, prompts, monkeypatch):
    model = quantize_model(tiny(), "int8")
    monkeypatch.setattr(FastDecoder, "rows", lambda *a: pytest.fail("the fused step ran"))
    params = RequestParams(max_new_tokens=4, eos_ids=())
    configs = (EngineConfig(n_blocks=32, kv_dtype="int8"), EngineConfig(n_blocks=32, attention="reference"))
    for config in configs:
        engine = Engine(model, None, config)
        handles = [engine.submit(p, params) for p in prompts([3, 6])]
        engine.run_until_done()
        assert all(len(h.wait(0).generated_ids) == 4 for h in handles)


def test_more_rows_than_a_kernel_tile_still_equal_the_per_layer_path(tiny, prompts):
    """12 decode rows: one fused call (the products take them all in one pass) against the
    per-layer path's tiles of 8."""
    model = quantize_model(tiny(), "int4")
    params = RequestParams(max_new_tokens=6, eos_ids=(), logprobs=2)
    todo = [(p, params) for p in prompts([5, 17, 3, 30, 1, 9, 2, 11, 4, 8, 6, 13])]
    config = EngineConfig(block_size=4, n_blocks=160, token_budget=64, max_batch=12)
    engine = Engine(model, None, config)
    handles = [engine.submit(*t) for t in todo]
    engine.run_until_done()
    assert max(len(t.requests) for t in engine.trace) == 12
    fused = [[(e.token_id, e.logprobs.logprob) for e in h if e.token_id is not None] for h in handles]
    expected = _events(model, todo, config, fused=False)
    for got, want in zip(fused, expected, strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        torch.testing.assert_close([lp for _, lp in got], [w.logprob for _, w in want], atol=1e-4, rtol=1e-4)
