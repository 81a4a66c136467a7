"""The HTTP server given hostile requests: traces on a converted model, adapters and steering
vectors with bad values, names or paths, runtime adapter loading left off by default, and a
lens larger than --max-capture-mb. Each is a 4xx naming the field, or, inside a stream, an error
event then [DONE]; never a 500 or a silently wrong answer."""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import pytest
import torch
from servers import serving

import glassformer
from glassformer.serving import EngineConfig
from glassformer.serving.api.server import ServerConfig


@pytest.fixture(scope="module")
def int4(gguf_file):
    return glassformer.load(gguf_file, quantize="int4")


@contextmanager
def client(language_model, config: ServerConfig | None = None):
    config = config or ServerConfig("m", max_tokens=16)
    with serving(language_model, config, EngineConfig(n_blocks=64), grace=2) as (url, _), \
            httpx.Client(base_url=url, timeout=30) as http:
        yield http


def events(reply: httpx.Response) -> list:
    """A stream's data lines, JSON decoded ([DONE] as is)."""
    lines = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


@pytest.mark.parametrize("site", ["logits", "blocks.1.attn.pattern", "final_norm"])
def test_a_trace_on_an_int4_server(site, int4):
    body = {"model": "m", "prompt": "ab", "max_tokens": 2, "glassformer": {"trace": [site]}}
    with client(int4) as http:
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        traced = reply.json()["glassformer"]["trace"][site]
        assert torch.isfinite(torch.tensor(traced)).all()
        streamed = events(http.post("/v1/completions", json=body | {"stream": True}))
        assert streamed[-1] == "[DONE]" and streamed[-2]["choices"][0]["finish_reason"] == "length"
        assert site in streamed[-2]["glassformer"]["trace"]


def test_a_failure_inside_a_stream_ends_it_with_an_error_event(gguf_file):
    body = {"model": "m", "prompt": "ab", "max_tokens": 2, "stream": True,
            "glassformer": {"trace": ["logits"]}}
    with serving(glassformer.load(gguf_file), ServerConfig("m"), EngineConfig(n_blocks=64), grace=2) \
            as (url, app), httpx.Client(base_url=url, timeout=30) as http:

        def broken(ids, names):
            raise RuntimeError("a bug")

        app.state.server.tracer.run = broken
        streamed = events(http.post("/v1/completions", json=body))
        assert streamed[-1] == "[DONE]"
        assert streamed[-2]["error"]["code"] == "internal_error" and "a bug" not in str(streamed)
        assert http.post("/v1/completions", json=body | {"glassformer": {}}).status_code == 200
