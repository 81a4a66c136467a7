"""The engine against `generate` (the oracle), and a request's output against its output alone."""

import random

import pytest
import torch

from glassformer.accel.fast_decode import FastDecoder
from glassformer.accel.quantize import quantize_model
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.generation.sampling import SamplingConfig
from glassformer.serving import Engine, EngineConfig, RequestParams, sampler
from glassformer.serving.errors import CapacityError

GREEDY = RequestParams(max_new_tokens=12, eos_ids=())
SAMPLED = RequestParams(max_new_tokens=12, eos_ids=(), seed=5,
                        sampling=SamplingConfig(temperature=1.0, top_k=20, repetition_penalty=1.2))


def _stepped(model, todo, config, arrivals=None, cancel=()):
    """Submit (prompt, params) pairs, request i just before step arrivals[i], cancelling those
    cancel[step] names, and step until done; returns the handles in request order and the engine."""
    engine = Engine(model, None, config)
    arrivals = arrivals or [0] * len(todo)
    handles, step = {}, 0
    while len(handles) < len(todo) or engine.has_work():
        for i, (prompt, params) in enumerate(todo):
            if arrivals[i] == step and i not in handles:
                handles[i] = engine.submit(prompt, params)
        if step in cancel:
            for i in cancel[step]:
                if i in handles:
                    handles[i].cancel()
        engine.step()
        step += 1
        assert step < 2000, "the engine did not finish"
    return [h for _, h in sorted(handles.items())], engine


def _run(model, todo, config, arrivals=None, cancel=()):
    """The generated ids per request (None when cancelled) and the engine (`_stepped`)."""
    handles, engine = _stepped(model, todo, config, arrivals, cancel)
    out = [h.result.generated_ids if h.result.stop_reason != "cancelled" else None for h in handles]
    return out, engine


def _assert_whole(engine):
    assert engine.blocks.used == 0 and engine.blocks.free_count == engine.blocks.n_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt1", "tiny-alibi", "tiny-mistral", "tiny-mqa"])
@pytest.mark.parametrize("attention", ["reference", "fast"])
def test_greedy_outputs_equal_generate(tiny, prompts, name, attention):
    model = tiny(name)
    todo = prompts([5, 17, 3, 30])
    expected = [generate(model, p, GenerationConfig(max_new_tokens=12, eos_ids=())).generated_ids
                for p in todo]
    config = EngineConfig(block_size=4, n_blocks=64, token_budget=16, max_batch=4, attention=attention)
    got, engine = _run(model, [(p, GREEDY) for p in todo], config)
    assert got == expected
    _assert_whole(engine)


def test_without_row_tiles_greedy_still_equals_generate(tiny, prompts):
    model = tiny()
    todo = prompts([5, 17, 3, 30])
    expected = [generate(model, p, GenerationConfig(max_new_tokens=12, eos_ids=())).generated_ids
                for p in todo]
    config = EngineConfig(n_blocks=64, token_budget=32, max_batch=4, batch_invariant=False)
    assert _run(model, [(p, GREEDY) for p in todo], config)[0] == expected


def test_seeded_sampling_equals_generate_with_the_same_seed(tiny, prompts):
    model = tiny()
    prompt = prompts([9])[0]
    config = GenerationConfig(max_new_tokens=12, eos_ids=(), seed=5, sampling=SAMPLED.sampling)
    expected = generate(model, prompt, config).generated_ids
    got, _ = _run(model, [(prompt, SAMPLED), (prompts([4], seed=3)[0], SAMPLED)], EngineConfig(n_blocks=32))
    assert got[0] == expected


@pytest.mark.parametrize("mode", [None, "none", "int8", "int4"])
@pytest.mark.parametrize("seed", range(3))
def test_a_request_gets_the_same_tokens_whatever_shares_its_steps(tiny, prompts, mode, seed):
    """Random arrivals, cancels, block sizes 1 and 16, chunk budgets, prefix cache on and off
    and a pool small enough to preempt: each request's logits equal its logits alone."""
    rng = random.Random(seed)
    model = tiny(rng.choice(["tiny-llama", "tiny-mistral"]))
    if mode is not None:
        quantize_model(model, mode)
    shared = prompts([rng.randint(4, 20)], seed=seed)[0]
    todo = []
    for i, p in enumerate(prompts([rng.randint(1, 24) for _ in range(7)], seed=seed + 10)):
        prompt = shared + p if rng.random() < 0.5 else p  # some share a prefix
        todo.append((prompt, GREEDY if i % 2 else SAMPLED))
    alone = [_run(model, [t], EngineConfig(attention="reference", n_blocks=64))[0][0] for t in todo]
    for block_size, prefix in ((1, True), (16, False), (4, True)):
        budget = rng.randint(4, 40)
        config = EngineConfig(attention="reference", block_size=block_size, prefix_caching=prefix,
                              max_batch=min(4, budget), token_budget=budget,
                              n_blocks=(48 // block_size) + 2)
        arrivals = [rng.randint(0, 12) for _ in todo]
        cancel = {rng.randint(0, 15): [rng.randrange(len(todo))]}
        got, engine = _run(model, todo, config, arrivals, cancel)
        for mine, solo in zip(got, alone, strict=True):
            assert mine is None or mine == solo
        _assert_whole(engine)
        assert sum(g is not None for g in got) >= len(todo) - 1


def _logprobs(model, todo, config, arrivals=None):
    """Each request's generated tokens' log-probabilities (`_stepped`)."""
    handles, _ = _stepped(model, todo, config, arrivals)
    return [[e.logprobs.logprob for e in h if e.token_id is not None] for h in handles]


def _on_fused_step(model) -> bool:
    """Whether the engine runs this model's rows through its fused C++ step."""
    with torch.no_grad():
        return isinstance(model.fused_step(), FastDecoder)


@pytest.mark.parametrize("mode", [None, "none", "int4"])
@pytest.mark.parametrize("seed", range(2))
def test_fast_attention_gives_a_request_the_same_numbers_whatever_shares_its_steps(tiny, prompts, mode,
                                                                                  seed):
    """The default attention: budgets that cut prompts anywhere, block sizes, shared prefixes
    from the cache (no preemption: a pool for all). On the fused step (Glassformer's own
    kernels, row by row) every log-probability is bit for bit that of the request alone; on
    the module path PyTorch's attention kernel may sum in another order by batch size, thread
    and alignment (MKL on AMD does), so the tokens are the same and the log-probabilities
    within float32 rounding."""
    rng = random.Random(seed)
    model = tiny(rng.choice(["tiny-llama", "tiny-mistral"]))
    if mode is not None:
        quantize_model(model, mode)
    shared = prompts([rng.randint(8, 20)], seed=seed)[0]
    params = RequestParams(max_new_tokens=6, eos_ids=(), logprobs=0)
    todo = [(shared + p if rng.random() < 0.5 else p, params)
            for p in prompts([rng.randint(1, 30) for _ in range(6)], seed=seed + 10)]
    for block_size in (4, 16):
        alone = [_stepped(model, [t], EngineConfig(block_size=block_size, n_blocks=256))[0][0] for t in todo]
        budget = rng.randint(6, 24)
        config = EngineConfig(block_size=block_size, token_budget=budget, max_batch=min(4, budget),
                              n_blocks=256)
        got, _ = _stepped(model, todo, config, [rng.randint(0, 8) for _ in todo])
        mine = [[(e.token_id, e.logprobs.logprob) for e in h if e.token_id is not None] for h in got]
        solo = [[(e.token_id, e.logprobs.logprob) for e in h if e.token_id is not None] for h in alone]
        if _on_fused_step(model):
            assert mine == solo
        else:
            assert [[t for t, _ in r] for r in mine] == [[t for t, _ in r] for r in solo]
            torch.testing.assert_close([[p for _, p in r] for r in mine], [[p for _, p in r] for r in solo],
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["none", "int4"])
def test_on_the_fused_step_a_preempted_request_gets_the_same_numbers(tiny, prompts, mode):
    """A converted model, every row on the fused step: requests recomputed after preemption get
    every log-probability bit for bit as alone."""
    model = quantize_model(tiny(), mode)
    params = RequestParams(max_new_tokens=8, eos_ids=(), logprobs=0)
    todo = [(p, params) for p in prompts([24, 20, 18, 22])]
    alone = [_logprobs(model, [t], EngineConfig(block_size=4, n_blocks=64))[0] for t in todo]
    config = EngineConfig(block_size=4, n_blocks=20, token_budget=64, max_batch=4)
    handles, engine = _stepped(model, todo, config, [0, 1, 1, 1])
    assert engine.stats.preemptions > 0
    got = [[e.logprobs.logprob for e in h if e.token_id is not None] for h in handles]
    if _on_fused_step(model):
        assert got == alone
    else:  # GLASSFORMER_KERNELS=torch: the module path, whose attention may round otherwise
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
    _assert_whole(engine)


def test_preemption_and_prefix_hits_are_counted(tiny, prompts):
    model = tiny()
    shared = prompts([24])[0]
    todo = [(shared + p, GREEDY) for p in prompts([3, 5, 2, 6])]
    config = EngineConfig(attention="reference", block_size=4, n_blocks=20, token_budget=64, max_batch=4)
    got, engine = _run(model, todo, config, arrivals=[0, 3, 3, 3])
    alone = [_run(model, [t], EngineConfig(n_blocks=64, attention="reference"))[0][0] for t in todo]
    assert got == alone
    assert engine.stats.prefix_hit_tokens >= 3 * 24 - 3 * 4
    assert engine.stats.preemptions > 0 and any(t.preempted for t in engine.trace)
    _assert_whole(engine)


def test_int8_kv_stays_close_to_fp32_kv(tiny, prompts):
    model = tiny()
    todo = [(p, GREEDY) for p in prompts([20, 30])]
    fp32, _ = _run(model, todo, EngineConfig(n_blocks=64))
    int8, engine = _run(model, todo, EngineConfig(n_blocks=64, kv_dtype="int8"))
    agree = sum(a == b for x, y in zip(fp32, int8, strict=True) for a, b in zip(x, y, strict=True))
    assert all(x[0] == y[0] for x, y in zip(fp32, int8, strict=True))
    assert agree >= 0.75 * sum(len(x) for x in fp32)
    _assert_whole(engine)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("attention", ["reference", "fast"])
def test_a_scaled_kv_pool_gives_the_tokens_of_generate_with_the_same_dense_cache(tiny, prompts, kv_dtype,
                                                                                 attention):
    model = tiny()
    todo = prompts([5, 17, 30])
    dense = GenerationConfig(max_new_tokens=12, eos_ids=(), kv_dtype=kv_dtype)
    expected = [generate(model, p, dense).generated_ids for p in todo]
    config = EngineConfig(block_size=4, n_blocks=64, token_budget=16, kv_dtype=kv_dtype, attention=attention)
    got, engine = _run(model, [(p, GREEDY) for p in todo], config)
    assert got == expected
    _assert_whole(engine)


def test_trace_and_counters(tiny, prompts):
    model = tiny()
    engine = Engine(model, None, EngineConfig(n_blocks=64, token_budget=8, max_batch=2))
    a = engine.submit(prompts([12])[0], GREEDY)
    b = engine.submit(prompts([3])[0], RequestParams(max_new_tokens=2, eos_ids=()))
    first = engine.step()
    assert first.requests == [(a.request_id, 8)] and first.n_tokens == 8
    engine.run_until_done()
    assert engine.stats.finished == 2 and engine.stats.tokens_generated == 14
    assert engine.stats.tokens_computed == 12 + 3 + 11 + 1
    assert any((b.request_id, 3) in t.requests for t in engine.trace)


def test_invalid_requests_raise_one_clear_error(tiny):
    engine = Engine(tiny(), None, EngineConfig(n_blocks=4, block_size=4))
    with pytest.raises(ValueError, match="context_length"):
        engine.submit([1] * 65)
    with pytest.raises(CapacityError, match="needs 32 tokens of cache .*; the engine holds 16"):
        engine.submit([1] * 10, RequestParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="stop"):
        engine.submit([1], RequestParams(stop=("x",)))
    with pytest.raises(ValueError, match="token ids"):
        engine.submit([96])
    with pytest.raises(ValueError, match="empty"):
        engine.submit([])
    with pytest.raises(ValueError, match="logprobs"):
        engine.submit([1], RequestParams(logprobs=97))


def test_a_request_that_fails_inside_a_step_fails_alone(tiny, prompts, monkeypatch):
    """A failure injected into one request's sampling in the middle of a batch: that request
    gets an error event, every other one the tokens it gets without it, and the engine goes on."""
    model = tiny()
    todo = [(p, SAMPLED) for p in prompts([5, 9, 7])] + [(prompts([6], seed=3)[0], GREEDY)]
    want, _ = _run(model, todo, EngineConfig(n_blocks=64))
    engine = Engine(model, None, EngineConfig(n_blocks=64))
    handles = [engine.submit(prompt, params) for prompt, params in todo]
    victim = handles[1].request_id
    draw = sampler.draw

    def failing(seq, logits):
        if seq.id == victim and len(seq.generated) == 3:
            raise RuntimeError("injected")
        return draw(seq, logits)

    monkeypatch.setattr(sampler, "draw", failing)
    engine.run_until_done()
    events = list(handles[1])
    assert [e.stop_reason for e in events[-1:]] == ["error"] and "injected" in events[-1].error
    assert handles[1].result.stop_reason == "error" and len(handles[1].result.generated_ids) == 3
    assert [handles[i].result.generated_ids for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    later = engine.submit(todo[0][0], SAMPLED)  # the engine still serves
    engine.run_until_done()
    assert later.result.generated_ids == want[0]
    _assert_whole(engine)


def test_a_chat_turn_reuses_the_blocks_of_its_history(tiny, prompts):
    model = tiny()
    engine = Engine(model, None, EngineConfig(n_blocks=64, block_size=4))
    first = engine.submit(prompts([10])[0], GREEDY)
    engine.run_until_done()
    history = first.result.prompt_ids + first.result.generated_ids  # 22 tokens: 5 full blocks
    second = engine.submit(history + prompts([3], seed=2)[0], GREEDY)
    before = engine.stats.prefix_hit_tokens
    engine.run_until_done()
    assert engine.stats.prefix_hit_tokens - before == 20
    alone = _run(model, [(history + prompts([3], seed=2)[0], GREEDY)], EngineConfig(n_blocks=64))[0][0]
    assert second.result.generated_ids == alone
    _assert_whole(engine)


def test_stepping_by_hand_is_refused_while_the_thread_runs(tiny):
    with Engine(tiny(), None, EngineConfig(n_blocks=8)) as engine:
        with pytest.raises(RuntimeError, match="own thread"):
            engine.step()


def test_the_pool_holds_only_the_blocks_the_requests_used(tiny, prompts):
    model = tiny()
    params = RequestParams(max_new_tokens=6, eos_ids=())
    grown = Engine(model, None, EngineConfig(block_size=4, n_blocks=500))
    full = Engine(model, None, EngineConfig(block_size=4, n_blocks=500))
    full.pool.reserve(500)
    results = []
    for engine in (grown, full):
        handles = [engine.submit(p, params) for p in prompts([3, 5])]
        engine.run_until_done()
        results.append([h.wait(0).generated_ids for h in handles])
    assert results[0] == results[1]
    assert grown.pool.allocated < 10 < full.pool.allocated == 500
