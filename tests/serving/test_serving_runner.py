"""The runner's fused decode steps against its per-layer path (the oracle, itself compared
with `generate` in test_engine.py)."""

import pytest
import torch

from glassformer.accel.fast_decode import FastDecoder
from glassformer.accel.quantize import quantize_model
from glassformer.generation.paths import MODULES, Path
from glassformer.serving import Engine, EngineConfig, RequestParams, executors
from glassformer.serving.executors import ModulePath

pytestmark = pytest.mark.usefixtures("kernels")


def _events(model, todo, config, fused):
    """Every request's (token, logprob, top logprobs) per step, arrivals staggered."""
    engine = Engine(model, None, config)
    if not fused:  # every row on the module path
        engine.runner.route = lambda seq: Path(MODULES, "the oracle")
    handles, step = [], 0
    while len(handles) < len(todo) or engine.has_work():
        if step < len(todo):
            handles.append(engine.submit(*todo[step]))
        engine.step()
        step += 1
    assert engine.blocks.used == 0
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


def _mixes_a_chunk(positions: list[int]) -> bool:
    """Whether a call's rows hold a run of consecutive positions (a prompt's chunk) and others."""
    steps = [b - a for a, b in zip(positions, positions[1:], strict=False)]
    return 1 in steps and any(step != 1 for step in steps)


@pytest.mark.parametrize("mode", ["none", "int4"])
def test_prompt_chunks_take_the_fused_step_and_each_token_is_the_same_however_cut(tiny, prompts, monkeypatch,
                                                                                  mode):
    """A prompt's rows go through the fused step too, a chunk's rows at their own positions: a
    request's tokens and log-probabilities are bit for bit the same whether its prompt comes in
    one chunk alone or cut into chunks of 4 beside other requests' chunks and new tokens."""
    model = quantize_model(tiny(), mode)
    calls = []
    original = FastDecoder.rows
    monkeypatch.setattr(FastDecoder, "rows", lambda self, x, positions, *a: calls.append(positions.tolist())
                        or original(self, x, positions, *a))
    monkeypatch.setattr(ModulePath, "execute", lambda *a: pytest.fail("a row took the module path"))
    params = RequestParams(max_new_tokens=8, eos_ids=(), logprobs=3)
    watched, *others = prompts([30, 9, 17, 5])

    def run(config, todo):
        engine = Engine(model, None, config)
        handles = []
        for request in todo:
            handles.append(engine.submit(request, params))
            engine.step()
        engine.run_until_done()
        return [(e.token_id, e.logprobs.logprob, e.logprobs.top)
                for e in handles[-1] if e.token_id is not None]

    alone = run(EngineConfig(block_size=4, n_blocks=64, token_budget=64, max_batch=4), [watched])
    assert calls[0] == list(range(30))  # the whole prompt in one call
    calls.clear()
    shared = run(EngineConfig(block_size=4, n_blocks=64, token_budget=8, max_batch=4), others + [watched])
    assert max(map(len, calls)) <= 8 and any(_mixes_a_chunk(c) for c in calls)
    assert alone == shared


def test_a_longer_prompt_keeps_the_module_path_and_its_new_tokens_the_fused_step(tiny, prompts, monkeypatch):
    """Past FUSED_PROMPT_TOKENS a prompt's rows take the module path (its attention a product
    over the chunk), its generated tokens the fused step; a shorter prompt's rows the fused
    step. Each request's numbers are still the same alone and cut into chunks beside others."""
    monkeypatch.setattr(executors, "FUSED_PROMPT_TOKENS", 16)
    model = quantize_model(tiny(), "int4")
    blocks, fused = [], []
    execute, rows = ModulePath.execute, FastDecoder.rows
    monkeypatch.setattr(ModulePath, "execute", lambda self, batch: blocks.append(
        [(len(r.seq.tokens), r.n) for r in batch.requests]) or execute(self, batch))
    monkeypatch.setattr(FastDecoder, "rows", lambda self, x, positions, *a: fused.append(positions.tolist())
                        or rows(self, x, positions, *a))
    params = RequestParams(max_new_tokens=6, eos_ids=(), logprobs=0)
    todo = [(p, params) for p in prompts([30, 9, 16])]
    alone = [_events(model, [t], EngineConfig(block_size=4, n_blocks=64), fused=True)[0] for t in todo]
    # the module path took the long prompt's 30 rows and nothing else; its last new token
    # (position 30 + 6 - 2) the fused step
    assert sum(n for call in blocks for _, n in call) == 30 and any(34 in call for call in fused)
    blocks.clear()
    config = EngineConfig(block_size=4, n_blocks=64, token_budget=8, max_batch=3)
    assert _events(model, todo, config, fused=True) == alone
    assert sum(n for call in blocks for _, n in call) == 30
