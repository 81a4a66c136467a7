"""The graph executor (serving/graph_path.py) and its FlexAttention paged attention
(serving/graph_path.py) against the module path over the same pool."""

import pytest
import torch

from glassformer.generation.config import RequestParams, Steer
from glassformer.generation.paths import MODULES
from glassformer.model.sink import SinkPolicy
from glassformer.serving import Engine, EngineConfig
from glassformer.serving.graph_path import (
    BUCKETS,
    GRAPH,
    FlexPagedCache,
    GraphPath,
    bucket_of,
    paged_block_mask,
)
from glassformer.serving.kv_pool import KVPool
from glassformer.serving.paged_attention import PagedView
from glassformer.serving.sequence import Sequence
from glassformer.serving.step import RequestRows, slots_of


def _engine(model, graph: bool, max_batch: int = 4) -> Engine:
    return Engine(model, None, EngineConfig(block_size=4, n_blocks=48, max_batch=max_batch,
                                            token_budget=16, compile=graph))


def _greedy(engine: Engine, prompts, new_tokens: int, params=None) -> list[list[int]]:
    params = params or [RequestParams(max_new_tokens=new_tokens, eos_ids=())] * len(prompts)
    asked = zip(prompts, params, strict=True)
    handles = [engine.submit(p, q, request_id=str(i)) for i, (p, q) in enumerate(asked)]
    engine.run_until_done()
    return [h.wait(0).generated_ids for h in handles]


def _paths(engine: Engine) -> dict[str, set[tuple[str, str]]]:
    seen: dict[str, set[tuple[str, str]]] = {}
    for trace in engine.trace:
        for (rid, _), path in zip(trace.requests, trace.paths, strict=True):
            seen.setdefault(rid, set()).add(path)
    return seen


def test_buckets_hold_every_batch_up_to_the_largest():
    assert [bucket_of(n) for n in (1, 2, 3, 5, 16, 17, 256)] == [1, 2, 4, 8, 16, 32, 256]
    assert BUCKETS[-1] == 256


@pytest.mark.parametrize("window", [None, 5])
def test_flex_paged_attention_matches_the_paged_view(tiny, window):
    """Three decoding rows of different lengths and one padding row (at the scratch block),
    compiled, against the reference paged view over the same pool."""
    model = tiny(sliding_window=window)
    config, bs = model.config, 4
    pool = KVPool(config, 12, bs, scratch=True)
    g = torch.Generator().manual_seed(0)
    for layer in range(config.n_layers):
        pool.keys[layer].copy_(torch.randn(pool.keys[layer].shape, generator=g))
        pool.values[layer].copy_(torch.randn(pool.values[layer].shape, generator=g))
    tables, lengths = [[3, 0, 7], [5], [1, 9]], [11, 2, 6]
    H, KV, d = config.n_heads, config.kv_heads, config.head_dim
    q = torch.randn(4, H, 1, d, generator=g)  # (B, H, 1, d_head): the last row pads
    k, v = torch.randn(4, KV, 1, d, generator=g), torch.randn(4, KV, 1, d, generator=g)
    slots = [slots_of(t, n, bs) for t, n in zip(tables, lengths, strict=True)]
    kv_blocks = torch.tensor([len(t) for t in tables] + [1], dtype=torch.int32).view(4, 1, 1)
    kv_indices = torch.full((4, 1, 1, 13), 12, dtype=torch.int32)
    block_position = torch.zeros(13, dtype=torch.long)
    for i, t in enumerate(tables):
        kv_indices[i, 0, 0, : len(t)] = torch.tensor(t)
        block_position[t] = torch.arange(len(t))
    positions = torch.tensor([n - 1 for n in lengths] + [0])
    new_slots = torch.stack([s[-1] for s in slots] + [torch.tensor(12 * bs)])

    def flex(keys, values):
        mask = paged_block_mask(kv_blocks, kv_indices, block_position, positions, bs, keys[0].shape[0],
                                window)
        return FlexPagedCache(keys, values, new_slots, mask, [None]).attend(0, q, k, v, None, None)

    keys, values = [t.clone() for t in pool.keys], [t.clone() for t in pool.values]
    got = torch.compile(flex, fullgraph=True, dynamic=False)(keys, values)  # (4, H, 1, d_head)
    parts = [RequestRows(None, i, 1, s) for i, s in enumerate(slots)]
    view = PagedView(pool, parts, True, model)
    attn = model.blocks[0].attn
    want = view.attend(0, q[:3, :, 0].transpose(0, 1)[None], k[:3, :, 0].transpose(0, 1)[None],
                       v[:3, :, 0].transpose(0, 1)[None], None, attn.context)  # (1, H, 3, d_head)
    torch.testing.assert_close(got[:3, :, 0], want[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys[0][: 12 * bs], pool.keys[0][: 12 * bs])  # padding wrote nowhere else
    assert torch.isfinite(got[3]).all()


def test_the_graph_decodes_as_the_module_path_without_recompiling(tiny, prompts):
    """Requests of different lengths side by side (buckets 4, 2, 1 as they finish), then again
    in a second engine run: greedy tokens equal to the module path's, and once each bucket is
    compiled no step compiles again."""
    model = tiny()
    asked = prompts([3, 9, 6])
    lengths = [6, 4, 2]
    want = [_greedy(_engine(model, graph=False), [p], n)[0] for p, n in zip(asked, lengths, strict=True)]
    engine = _engine(model, graph=True)
    params = [RequestParams(max_new_tokens=n, eos_ids=()) for n in lengths]
    assert _greedy(engine, asked, 0, params) == want
    assert {path for path, _ in _paths(engine)["0"]} == {GRAPH, MODULES}  # its prompt, then its tokens
    with torch.compiler.set_stance("fail_on_recompile"):
        again = _engine(model, graph=True)
        assert _greedy(again, asked, 0, params) == want  # the same buckets: no compile


def test_bucket_padding_leaves_a_rows_numbers_alone(tiny, prompts):
    """A request's tokens and log-probabilities alone (bucket 1) and beside two others (bucket
    4, one padding row)."""
    model = tiny()
    asked = prompts([5, 7, 4], seed=3)
    runs = []
    for batch in ([asked[0]], asked):
        engine = _engine(model, graph=True)
        params = RequestParams(max_new_tokens=3, eos_ids=(), logprobs=0)
        handles = [engine.submit(p, params, request_id=str(i)) for i, p in enumerate(batch)]
        engine.run_until_done()
        runs.append([(e.token_id, e.logprobs.logprob) for e in handles[0] if e.token_id is not None])
    alone, shared = runs
    assert [t for t, _ in alone] == [t for t, _ in shared]
    torch.testing.assert_close(torch.tensor([lp for _, lp in alone]), torch.tensor([lp for _, lp in shared]),
                               rtol=1e-5, atol=1e-5)


def test_inspecting_rows_keep_the_module_path_with_their_reason(tiny, prompts):
    model = tiny()
    d = model.config.d_model
    asks = [RequestParams(max_new_tokens=2, eos_ids=(), capture=("blocks.0.resid_post",)),
            RequestParams(max_new_tokens=2, eos_ids=(),
                          steer=(Steer("blocks.0.resid_post", torch.ones(d), 0.5),))]
    engine = _engine(model, graph=True)
    _greedy(engine, prompts([4, 5]), 0, asks)
    seen = _paths(engine)
    inspects = (MODULES, "it captures, steers or reads the lens (the graph executor has no hook sites)")
    chunk = (MODULES, "a prompt's chunk (the graph executor runs one new token per row)")
    assert seen["0"] == seen["1"] == {inspects, chunk}


PLAIN = RequestParams()


def _decoding(params: RequestParams, in_prompt: bool = False) -> RequestRows:
    """One row of a request of 6 prompt tokens: its first new token's, or its prompt's last."""
    seq = Sequence(list(range(1, 7)), params, 64)
    seq.num_computed = 5 if in_prompt else 6
    return RequestRows(seq, 0, 1, torch.arange(seq.num_computed + 1))


@pytest.mark.parametrize(("config", "params", "in_prompt"), [
    (EngineConfig(kv_dtype="int8"), PLAIN, False), (EngineConfig(sink=SinkPolicy(4, 8)), PLAIN, False),
    (EngineConfig(attention="reference"), PLAIN, False), (EngineConfig(), PLAIN, True),
    (EngineConfig(), RequestParams(steer=(Steer("blocks.0.resid_post", torch.ones(64), 0.5),)), False),
    (EngineConfig(), RequestParams(capture=("blocks.0.norm1",)), False),
    (EngineConfig(), RequestParams(lens=2), False), (EngineConfig(), RequestParams(adapter="a"), False),
])
def test_a_row_the_graph_executor_declines_names_it_not_the_fused_step(tiny, config, params, in_prompt):
    """Where the engine runs the graph executor, every module-path reason names the executor
    that declined the row; a plain decoding row of the same engine it takes where its pool lets it."""
    model = tiny()
    executor = GraphPath(model, KVPool(model.config, 4, 4, scratch=True), config, None)
    reason = executor.refuses(_decoding(params, in_prompt))
    assert "graph executor" in reason and "fused step" not in reason
    assert (executor.refuses(_decoding(PLAIN)) is None) == (config == EngineConfig())
