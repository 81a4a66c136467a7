"""The serving engine and the server's settings given hostile values from Python: each refused
at construction in one line naming the field, and the engine serving on afterwards."""

from __future__ import annotations

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.generation.config import GenerationConfig
from glassformer.serving import Engine, EngineConfig, RequestParams
from glassformer.serving.api.server import ServerConfig

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(get_preset("tiny-llama").replace(context_length=64)).eval()


@pytest.mark.parametrize(("field", "value"), [
    ("max_new_tokens", 2.5), ("max_new_tokens", NAN), ("max_new_tokens", INF), ("max_new_tokens", "5"),
    ("max_new_tokens", True), ("max_new_tokens", 0), ("beams", 2.0), ("beams", 0), ("logprobs", 1.5),
    ("logprobs", -1), ("logprobs", NAN), ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.0),
    ("length_penalty", NAN), ("length_penalty", INF), ("stop", "x"), ("stop", ("",)), ("stop", (1,)),
    ("eos_ids", (1.5,)), ("eos_ids", [1]), ("eos_ids", (-1,)), ("sampling", {"temperature": 1.0}),
])
def test_every_request_field_is_checked_at_construction(field, value):
    for kind in (RequestParams, GenerationConfig):
        with pytest.raises(ValueError, match=f"^{field}: "):
            kind(**{field: value})


@pytest.mark.parametrize(("field", "value"), [
    ("top_k", 2.5), ("top_k", "3"), ("temperature", INF), ("top_p", NAN), ("min_p", "0.1"),
    ("max_new_tokens", "5"), ("logprobs", 1.5), ("use_cache", "no"), ("overflow", "wrap")])
def test_flat_settings_name_the_field(field, value):
    """As a JSON line of `glassformer generate --prompts-file` gives them."""
    kind = GenerationConfig if field in ("use_cache", "overflow") else RequestParams
    with pytest.raises(ValueError, match=f"^{field}: "):
        kind.from_fields(**{field: value})


def test_the_engine_refuses_at_submit_and_serves_on(model):
    engine = Engine(model, None, EngineConfig(n_blocks=16, block_size=4))
    for params, field in (({"max_new_tokens": 2}, "params"), (RequestParams(logprobs=1000), "logprobs")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            engine.submit([1, 2, 3], params)
    for prompt in ([1.5, 2], [True], ["a"]):
        with pytest.raises(ValueError, match="^prompt: "):
            engine.submit(prompt)
    handle = engine.submit([1, 2, 3], RequestParams(max_new_tokens=3, eos_ids=(), logprobs=2))
    engine.run_until_done()
    result = handle.wait(0)
    assert result.stop_reason == "max_new_tokens" and len(result.generated_ids) == 3


def test_submit_and_start_after_close_raise(model):
    engine = Engine(model, None, EngineConfig(n_blocks=8)).start()
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([1, 2])
    with pytest.raises(RuntimeError, match="closed"):
        engine.start()


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 2.5), ("max_queue", -1), ("body_timeout_s", 0), ("request_timeout_s", INF),
    ("allowed_hosts", "localhost"), ("allowed_origins", ("",))])
def test_server_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        ServerConfig("m", **{field: value})
