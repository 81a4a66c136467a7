"""EngineConfig.deterministic: on the CPU it changes nothing (the engine is batch invariant
there already); the fixed shapes it turns on for CUDA (norms in row tiles, one attention call
per decoding row, the graph at one bucket) run on the CPU too, where a request's tokens alone
and in a batch of mixed requests must agree, as on the module path without them."""

import pytest
import torch

from glassformer.serving import Engine, EngineConfig
from glassformer.serving.graph_path import GRAPH
from glassformer.serving.kv_pool import KVPool
from glassformer.serving.paged_attention import PagedView
from glassformer.serving.row_tiles import RowTiles
from glassformer.serving.runner import ModelRunner
from glassformer.serving.step import RequestRows, slots_of

CONFIG = EngineConfig(block_size=4, n_blocks=96, max_batch=8, token_budget=32)


def _engine(model, config: EngineConfig, deterministic: bool = False) -> Engine:
    engine = Engine(model, None, config)
    if deterministic:  # what the engine builds on CUDA with deterministic=True
        engine.runner = ModelRunner(model, engine.pool, config, engine.adapters, deterministic=True)
    return engine


def _first_request(engine: Engine, requests) -> list[tuple[int, float]]:
    handles = [engine.submit(p, q, request_id=str(i)) for i, (p, q) in enumerate(requests)]
    engine.run_until_done()
    return [(e.token_id, e.logprobs.logprob) for e in handles[0] if e.token_id is not None]


def test_deterministic_on_the_cpu_changes_nothing(tiny, mixed_requests):
    model, requests = tiny(), mixed_requests(4)
    plain = _first_request(_engine(model, CONFIG), requests)
    engine = _engine(model, EngineConfig(**{**CONFIG.__dict__, "deterministic": True}))
    assert _first_request(engine, requests) == plain
    assert not any(isinstance(m, RowTiles) and "norm" in n for n, m in engine.runner.layers.named_modules())


def test_deterministic_needs_row_invariant_products():
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(deterministic=True, batch_invariant=False)


@pytest.mark.parametrize("graph", [False, True])
def test_fixed_shapes_keep_a_requests_tokens_alone_and_in_a_mixed_batch(tiny, mixed_requests, graph):
    """The watched request alone, then beside seven others: the same tokens and log-
    probabilities, and the same as the engine without fixed shapes."""
    model, requests = tiny(), mixed_requests(4)
    config = EngineConfig(**{**CONFIG.__dict__, "compile": graph})
    alone = _first_request(_engine(model, config, deterministic=True), requests[:1])
    engine = _engine(model, config, deterministic=True)
    shared = _first_request(engine, requests)
    if graph:  # every step padded to the one bucket that holds max_batch
        assert engine.runner.executors[0].name == GRAPH and set(engine.runner.executors[0].buffers) == {8}
    plain = _first_request(_engine(model, CONFIG), requests[:1])
    for run in (shared, plain):
        assert [t for t, _ in run] == [t for t, _ in alone]
        torch.testing.assert_close(torch.tensor([lp for _, lp in run]), torch.tensor([lp for _, lp in alone]),
                                   rtol=1e-5, atol=1e-5)


def test_tiled_norms_compute_the_norms_they_wrap(tiny, prompts):
    model = tiny(qk_norm="head")
    engine = _engine(model, CONFIG, deterministic=True)
    tiled = {n: m for n, m in engine.runner.layers.named_modules() if isinstance(m, RowTiles)
             and "norm" in n}
    assert "final_norm" in tiled and "blocks.0.attn.q_norm" in tiled
    x = torch.randn(1, 21, model.config.d_model, generator=torch.Generator().manual_seed(0))  # (1, N, d)
    torch.testing.assert_close(tiled["final_norm"](x), model.final_norm(x))


def test_alone_gives_each_decoding_row_its_own_attention_call(tiny):
    model = tiny()
    pool = KVPool(model.config, 16, 4)
    parts = [RequestRows(None, 0, 1, slots_of([0, 1], 6, 4)), RequestRows(None, 1, 1, slots_of([2, 3], 7, 4)),
             RequestRows(None, 2, 1, slots_of([4], 3, 4))]
    together = PagedView(pool, parts, True, model)
    alone = PagedView(pool, parts, True, model, deterministic=True)
    assert [len(rows) for rows, _, _ in together.single] == [2, 1]  # by padded length: 8, 4
    assert [rows.tolist() for rows, _, _ in alone.single] == [[0], [1], [2]]
