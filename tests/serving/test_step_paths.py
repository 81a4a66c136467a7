"""The step as a value: each request's path, chosen by one function (generation/paths.py
choose_path) and recorded with its reason in the engine's step trace."""

import pytest
import torch

from glassformer.accel.fast_decode import FastDecoder
from glassformer.accel.quantize import quantize_model
from glassformer.generation import core
from glassformer.generation.config import GenerationConfig, RequestParams, Steer
from glassformer.generation.generate import generate
from glassformer.generation.paths import FUSED, FUSED_PROMPT_TOKENS, MODULES, Asks, Path, choose_path
from glassformer.model.transformer import Transformer
from glassformer.serving import Engine, EngineConfig, runner

pytestmark = pytest.mark.usefixtures("kernels")


def _paths(engine: Engine) -> dict[str, set[tuple[str, str]]]:
    """Each request's (path, reason) over the engine's steps."""
    seen: dict[str, set[tuple[str, str]]] = {}
    for trace in engine.trace:
        assert len(trace.paths) == len(trace.requests)
        for (rid, _), path in zip(trace.requests, trace.paths, strict=True):
            seen.setdefault(rid, set()).add(path)
    return seen


def test_the_trace_names_each_rows_path_and_reason(tiny, prompts):
    model = quantize_model(tiny(), "int4")
    d = model.config.d_model
    asks = {"plain": RequestParams(max_new_tokens=3, eos_ids=()),
            "hooked": RequestParams(max_new_tokens=3, eos_ids=(), capture=("blocks.0.attn.q",)),
            "steered": RequestParams(max_new_tokens=3, eos_ids=(),
                                     steer=(Steer("blocks.0.resid_post", torch.ones(d), 0.5),)),
            "residuals": RequestParams(max_new_tokens=3, eos_ids=(), capture=("blocks.1.resid_post",))}
    engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=64))
    for (name, params), prompt in zip(asks.items(), prompts([5, 7, 6, 4]), strict=True):
        engine.submit(prompt, params, request_id=name)
    engine.run_until_done()
    seen = _paths(engine)
    assert seen["plain"] == {(FUSED, "the fused step computes every row it asks")}
    assert seen["hooked"] == {(MODULES, "it captures blocks.0.attn.q, a site the fused step does not emit")}
    assert seen["steered"] == {(MODULES, "it steers or ablates (the fused step has no hook sites)")}
    assert {path for path, _ in seen["residuals"]} == {FUSED}


def test_a_plain_model_names_its_module_path(tiny, prompts):
    engine = Engine(tiny(), None, EngineConfig(block_size=4, n_blocks=32))
    engine.submit(prompts([5])[0], RequestParams(max_new_tokens=2, eos_ids=()), request_id="a")
    engine.run_until_done()
    assert _paths(engine)["a"] == {(MODULES, "the model has no fused step (glassformer.quantize gives one)")}


def test_the_engine_takes_each_path_from_choose_path(tiny, prompts, monkeypatch):
    """The engine's rows go where choose_path says: told the module path, no row takes the fused
    step, and the trace records the path it gave."""
    model = quantize_model(tiny(), "int4")
    asked = []

    def decide(m, asks):
        asked.append(asks)
        return Path(MODULES, "told so")

    monkeypatch.setattr(runner, "choose_path", decide)
    monkeypatch.setattr(FastDecoder, "rows", lambda *a: pytest.fail("the fused step ran"))
    engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=32))
    engine.submit(prompts([5])[0], RequestParams(max_new_tokens=3, eos_ids=()), request_id="a")
    engine.run_until_done()
    assert asked and all(a.paged and a.params is not None for a in asked)
    assert _paths(engine)["a"] == {(MODULES, "told so")}


def test_decode_one_token_takes_its_path_from_choose_path(tiny, monkeypatch):
    model = quantize_model(tiny(), "int4")
    config = GenerationConfig(max_new_tokens=4, eos_ids=())
    fused = generate(model, [3, 5, 7], config).generated_ids
    monkeypatch.setattr(core, "choose_path", lambda m, asks: Path(MODULES, "told so"))
    monkeypatch.setattr(FastDecoder, "__call__", lambda *a: pytest.fail("the fused step ran"))
    assert generate(model, [3, 5, 7], config).generated_ids == fused


@pytest.mark.parametrize(("asks", "reason"), [
    (Asks(kv_dtype="int8"), "int8 keys and values"),
    (Asks(moves_keys=True), "sink policy"),
    (Asks(sequences=2), "several sequences"),
    (Asks(own_positions=True), "padded rows"),
    (Asks(paged=True, attention="reference"), "reference attention"),
    (Asks(paged=True, params=RequestParams(ablate=("blocks.0.attn.head.1",))), "steers or ablates"),
    (Asks(paged=True, params=RequestParams(capture=("blocks.0.norm1",))), "blocks.0.norm1"),
    (Asks(paged=True, params=RequestParams(adapter="a"), adapter_fused=False), "adapter 'a'"),
    (Asks(paged=True, prompt=FUSED_PROMPT_TOKENS + 1), "a prompt over"),
])
def test_choose_path_names_why_a_row_keeps_the_module_path(tiny, asks, reason):
    model = quantize_model(tiny(), "int4")
    with torch.inference_mode():
        path = choose_path(model, asks)
        assert path.name == MODULES and reason in path.reason
        assert choose_path(model, Asks(paged=True)).name == FUSED  # the same model, a plain row


def test_choose_path_asks_the_model_for_its_step(tiny):
    model = quantize_model(tiny(), "int4")
    assert "no grad" in choose_path(model, Asks()).reason  # grad on: the step declines
    with torch.inference_mode():
        assert choose_path(model, Asks()).name == FUSED
        assert choose_path(Transformer(model.config).eval(), Asks()).name == MODULES
        ok = RequestParams(capture=("embed.out", "blocks.0.mlp.out"), lens=2)
        assert choose_path(model, Asks(paged=True, params=ok)).name == FUSED
