"""The step as a value: each request's path, chosen by one function (serving/step.py route,
from what each executor refuses) and recorded with its reason in the engine's step trace; the
dense decode's own choice (generation/paths.py choose_path)."""

import pytest
import torch

from glassformer.accel.fast_decode import FastDecoder
from glassformer.accel.quantize import quantize_model
from glassformer.generation import core
from glassformer.generation.config import GenerationConfig, RequestParams, Steer
from glassformer.generation.generate import generate
from glassformer.generation.paths import FUSED, MODULES, Asks, Path, choose_path
from glassformer.model.transformer import Transformer
from glassformer.serving import Engine, EngineConfig, runner
from glassformer.serving.executors import FUSED_PROMPT_TOKENS, FusedPath
from glassformer.serving.sequence import Sequence
from glassformer.serving.step import RequestRows

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


def test_the_engine_takes_each_path_from_route(tiny, prompts, monkeypatch):
    """The engine's rows go where route says: told the module path, no row takes the fused
    step, and the trace records the path it gave."""
    model = quantize_model(tiny(), "int4")
    asked = []

    def decide(executors, rows):
        asked.append(rows)
        return Path(MODULES, "told so")

    monkeypatch.setattr(runner, "route", decide)
    monkeypatch.setattr(FastDecoder, "rows", lambda *a: pytest.fail("the fused step ran"))
    engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=32))
    engine.submit(prompts([5])[0], RequestParams(max_new_tokens=3, eos_ids=()), request_id="a")
    engine.run_until_done()
    assert asked and all(rows.seq.id == "a" and rows.path is None for rows in asked)
    assert _paths(engine)["a"] == {(MODULES, "told so")}


def test_decode_one_token_takes_its_path_from_choose_path(tiny, monkeypatch):
    model = quantize_model(tiny(), "int4")
    config = GenerationConfig(max_new_tokens=4, eos_ids=())
    fused = generate(model, [3, 5, 7], config).generated_ids
    monkeypatch.setattr(core, "choose_path", lambda m, asks: Path(MODULES, "told so"))
    monkeypatch.setattr(FastDecoder, "__call__", lambda *a: pytest.fail("the fused step ran"))
    assert generate(model, [3, 5, 7], config).generated_ids == fused


class _Adapter:
    fused = None  # an adapter not built for the fused step


def _rows(params: RequestParams, prompt: int = 6) -> RequestRows:
    """A request's first new token's row, after a prompt of `prompt` tokens."""
    seq = Sequence(list(range(1, prompt + 1)), params, 64)
    seq.num_computed = prompt
    return RequestRows(seq, 0, 1, torch.arange(prompt + 1))


@pytest.mark.parametrize(("config", "rows", "reason"), [
    (EngineConfig(kv_dtype="int8"), _rows(RequestParams()), "int8 keys and values"),
    (EngineConfig(attention="reference"), _rows(RequestParams()), "reference attention"),
    (EngineConfig(), _rows(RequestParams(ablate=("blocks.0.attn.head.1",))), "steers or ablates"),
    (EngineConfig(), _rows(RequestParams(capture=("blocks.0.norm1",))), "blocks.0.norm1"),
    (EngineConfig(), _rows(RequestParams(adapter="a")), "adapter 'a'"),
    (EngineConfig(), _rows(RequestParams(), FUSED_PROMPT_TOKENS + 1), None),  # its new tokens: fused
])
def test_the_fused_step_names_why_it_refuses_a_row(tiny, config, rows, reason):
    model = quantize_model(tiny(), "int4")
    fused = FusedPath(model, None, config, None, {"a": _Adapter()})
    with torch.inference_mode():
        refused = fused.refuses(rows)
        assert refused is None if reason is None else reason in refused
        assert FusedPath(model, None, EngineConfig(), None, {}).refuses(_rows(RequestParams())) is None
        rows.seq.num_computed = 0  # its prompt's rows: a long one's keep the module path
        long = fused.refuses(rows)
        assert ("a prompt over" in long) if rows.seq.prompt_len > FUSED_PROMPT_TOKENS else long == refused


def test_the_fused_step_takes_a_plain_models_rows_nowhere(tiny):
    with torch.inference_mode():
        refused = FusedPath(tiny(), None, EngineConfig(), None, {}).refuses(_rows(RequestParams()))
    assert refused == "the model has no fused step (glassformer.quantize gives one)"


@pytest.mark.parametrize(("asks", "reason"), [
    (Asks(kv_dtype="int8"), "int8 keys and values"),
    (Asks(moves_keys=True), "sink policy"),
    (Asks(sequences=2), "several sequences"),
    (Asks(own_positions=True), "padded rows"),
])
def test_choose_path_names_why_a_dense_step_keeps_the_module_path(tiny, asks, reason):
    model = quantize_model(tiny(), "int4")
    with torch.inference_mode():
        path = choose_path(model, asks)
        assert path.name == MODULES and reason in path.reason
        assert choose_path(model, Asks()).name == FUSED  # the same model, a plain step


def test_choose_path_asks_the_model_for_its_step(tiny):
    model = quantize_model(tiny(), "int4")
    assert choose_path(model, Asks()).name == MODULES  # grad on: the step declines
    with torch.inference_mode():
        assert choose_path(model, Asks()).name == FUSED
        assert choose_path(Transformer(model.config).eval(), Asks()).name == MODULES
        ok = _rows(RequestParams(capture=("embed.out", "blocks.0.mlp.out"), lens=2))
        fused = FusedPath(model, None, EngineConfig(), None, {})
        assert fused.refuses(ok) is None and "captures only sites" in fused.takes(ok)
