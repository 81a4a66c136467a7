"""The HTTP server given hostile requests: traces on a converted model, adapters and steering
vectors with bad values, names or paths, runtime adapter loading left off by default, and a
lens larger than --max-capture-mb. Each is a 4xx naming the field, or, inside a stream, an error
event then [DONE]; never a 500 or a silently wrong answer."""

from __future__ import annotations

import copy
import json
import re
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from servers import serving

import glassformer
from glassformer.generation.config import Steer
from glassformer.interpret.steer import SteeringVector
from glassformer.serving import Engine, EngineConfig, RequestParams
from glassformer.serving.api.server import ServerConfig
from glassformer.training.lora import LoRAConfig, add_lora, save_adapter


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
        # a whole stream: its last chunk names why it ended (the sampled tokens may reach the end
        # of text before max_tokens) and [DONE] follows
        assert streamed[-1] == "[DONE]" and streamed[-2]["choices"][0]["finish_reason"] in ("length", "stop")
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


@pytest.fixture(scope="module")
def lm(gguf_file):
    return glassformer.load(gguf_file)


@pytest.fixture(scope="module")
def adapters(lm, tmp_path_factory):
    """Adapter folders for the tiny model under one root: "good", and "nan" whose layer-0 q
    lora_A is all NaN."""
    root = tmp_path_factory.mktemp("adapters")
    config = LoRAConfig(2, 4.0)
    for name in ("good", "nan"):
        wrapped = copy.deepcopy(lm.model)
        add_lora(wrapped, config)
        with torch.no_grad():
            for key, param in wrapped.named_parameters():
                if "lora_" in key:
                    param.fill_(0.01)
            if name == "nan":
                wrapped.get_submodule("blocks.0.attn.qkv").lora_A["q"].fill_(float("nan"))
        (root / name).mkdir()
        save_adapter(root / name, wrapped, config, "")
    return root


def complete(http, **fields) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "m", "prompt": "ab", "max_tokens": 2} | fields)


def api_refused(reply: httpx.Response, status: int, param: str | None, *words: str) -> str:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert all(word in error["message"] for word in words), error
    return error["message"]


def test_an_adapter_holding_nan_is_refused_by_name(lm, adapters):
    config = ServerConfig("m", max_tokens=16, lora_dirs=(str(adapters),))
    with client(lm, config) as http:
        load = {"lora_name": "bad", "lora_path": str(adapters / "nan")}
        message = api_refused(http.post("/v1/load_lora_adapter", json=load), 400, "lora_path")
        assert "lora_A" in message and ("q_proj" in message or " q " in message) and "NaN" in message
        assert complete(http, model="bad").status_code == 404


def test_serve_refuses_an_adapter_holding_nan_at_start(adapters, gguf_file, refused):
    refused(["serve", "--model", gguf_file, "--lora", f"bad={adapters / 'nan'}"], "lora_A")


def test_runtime_adapter_loading_is_off_unless_turned_on(lm, adapters):
    load = {"lora_name": "good", "lora_path": str(adapters / "good")}
    with client(lm) as http:
        for route, body in (("/v1/load_lora_adapter", load), ("/v1/unload_lora_adapter", {"lora_name": "x"})):
            reply = http.post(route, json=body)
            assert reply.status_code == 403 and reply.json()["error"]["code"] == "runtime_lora_off"
    config = ServerConfig("m", max_tokens=16, lora_dirs=(str(adapters),))
    with client(lm, config) as http:
        outside = [(path, http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path}))
                   for path in ("/proc/1/root", "/etc", "/no/such/folder", str(adapters / ".." / "x"),
                                str(adapters) + "x", "relative")]
        messages = set()
        for path, reply in outside:
            assert reply.status_code == 403, (path, reply.text)
            messages.add(reply.json()["error"]["message"])
        assert len(messages) == 1  # the same whether the path exists or not
        (adapters / "link").symlink_to("/etc")
        assert http.post("/v1/load_lora_adapter",
                         json={"lora_name": "x", "lora_path": str(adapters / "link")}).status_code == 403
        missing = {"lora_name": "x", "lora_path": str(adapters / "none")}
        api_refused(http.post("/v1/load_lora_adapter", json=missing), 400, "lora_path")
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 200
        assert complete(http, model="good").status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "good"}).status_code == 200


@pytest.mark.parametrize("name", ["<script>alert(1)</script>", "a b", "../x", "", "x" * 65, "-x"])
def test_adapter_and_vector_names_are_restricted(name, lm, adapters):
    config = ServerConfig("m", max_tokens=16, lora_dirs=(str(adapters),))
    d = lm.config.d_model
    with client(lm, config) as http:
        load = {"lora_name": name, "lora_path": str(adapters / "good")}
        api_refused(http.post("/v1/load_lora_adapter", json=load), 400, "lora_name")
        upload = {"model": "m", "name": name, "site": "blocks.0.resid_post", "vector": [0.1] * d}
        api_refused(http.post("/v1/steering_vectors", json=upload), 400, "name")
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["m"]


def test_the_live_page_sets_text_never_markup():
    page = (Path(glassformer.__file__).parent / "serving" / "api" / "ui.html").read_text()
    assert re.findall(r"innerHTML\s*=\s*([^;]*);", page) == ['""']
    assert "insertAdjacentHTML" not in page and "outerHTML" not in page and "document.write" not in page


def test_a_steering_vector_name_is_not_replaced(lm, tmp_path):
    d = lm.config.d_model
    path = SteeringVector(torch.full((d,), 0.1), "blocks.0.resid_post", "m").save(tmp_path / "v.safetensors")
    with serving(lm, ServerConfig("m"), EngineConfig(n_blocks=64), grace=2) as (url, app), \
            httpx.Client(base_url=url, timeout=30) as http:
        app.state.server.steering.add("started", SteeringVector.load(path))
        upload = {"model": "m", "name": "up", "site": "blocks.0.resid_post", "vector": [0.1] * d}
        assert http.post("/v1/steering_vectors", json=upload).status_code == 200
        for name in ("up", "started"):
            again = upload | {"name": name, "vector": [0.5] * d}
            api_refused(http.post("/v1/steering_vectors", json=again), 400, "name", repr(name))
        widths = {v["id"]: v for v in http.get("/v1/steering_vectors").json()["data"]}
        assert set(widths) == {"up", "started"}
        assert torch.equal(app.state.server.steering._vectors["up"].vector, torch.full((d,), 0.1))


def test_serve_refuses_a_name_given_twice(tmp_path, gguf_file, refused):
    refused(["serve", "--model", gguf_file, "--lora", f"x={tmp_path}", "--lora", f"x={tmp_path}"],
                "--lora: the name 'x' is given twice")
    refused(["serve", "--model", gguf_file, "--steer", f"v={tmp_path}", "--steer", f"v={tmp_path}"],
                "--steer: the name 'v' is given twice")
    refused(["serve", "--model", gguf_file, "--lora-dir", tmp_path / "missing"], "--lora-dir")


def test_a_huge_or_non_finite_steer_is_refused(lm):
    d = lm.config.d_model
    with client(lm) as http:
        upload = {"model": "m", "name": "v", "site": "blocks.0.resid_post", "vector": [1.0] * d}
        assert http.post("/v1/steering_vectors", json=upload).status_code == 200
        huge = upload | {"name": "w", "vector": [1e300] * d}  # finite JSON, Inf in float32
        assert "'w'" in api_refused(http.post("/v1/steering_vectors", json=huge), 400, "vector")
        for alpha in (1e38, -1e7, 2e6):
            reply = complete(http, glassformer={"steer": [{"vector": "v", "alpha": alpha}]})
            assert reply.status_code == 400 and "steer" in reply.json()["error"]["param"], reply.text
            assert "overflow" in reply.json()["error"]["message"]
        assert complete(http, glassformer={"steer": [{"vector": "v", "alpha": 1e3}]}).status_code == 200
    with pytest.raises(ValueError, match="^steer: .*overflow"):
        Steer("blocks.0.resid_post", torch.full((d,), 1e30), 1.0)


def test_non_finite_logits_end_the_request_with_an_error(lm):
    model = copy.deepcopy(lm.model)
    with torch.no_grad():
        model.lm_head.weight[5] = float("inf")
    engine = Engine(model, None, EngineConfig(n_blocks=16, block_size=4))
    handle = engine.submit([1, 2, 3], RequestParams(max_new_tokens=3, eos_ids=()))
    engine.run_until_done()
    events = list(handle)
    assert events[-1].stop_reason == "error" and "NaN or Inf" in events[-1].error
    assert [e.token_id for e in events[:-1]] == []


def test_glassformer_null_names_the_field(lm):
    with client(lm) as http:
        for value in (None, [], 3):
            body = {"model": "m", "prompt": "ab", "glassformer": value}
            api_refused(http.post("/v1/completions", json=body), 400, "glassformer",
                        "glassformer: must be a JSON object")


@pytest.mark.parametrize("stream", [False, True])
def test_max_capture_mb_bounds_the_body(stream, lm):
    most = 0.05
    asks = [{"lens": {"top_k": 20}}, {"lens": {"top_k": 20, "layers": [0, 2]}},
            {"trace": ["blocks.0.resid_post", "blocks.1.attn.pattern", "logits"]},
            {"trace": ["blocks.0.mlp.hidden"], "lens": {"top_k": 3}}]
    with client(lm, ServerConfig("m", max_tokens=64, max_capture_mb=most)) as http:
        answered = refused_count = 0
        for ask in asks:
            for tokens in (4, 16, 48):
                reply = complete(http, max_tokens=tokens, glassformer=ask, stream=stream,
                                 prompt="ab" * 6)
                if reply.status_code == 400:
                    assert reply.json()["error"]["code"] == "capture_too_large"
                    refused_count += 1
                    continue
                assert reply.status_code == 200, reply.text
                assert len(reply.content) <= most * 2**20, (ask, tokens, len(reply.content))
                answered += 1
        assert answered and refused_count


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"n": 17}, "n", "16"),
    ({"n": 0}, "n", "1"),
    ({"n": 3, "best_of": 2}, "best_of", "at least n"),
    ({"best_of": 17}, "best_of", "16"),
    ({"n": 2, "stream": True, "use_beam_search": True}, "use_beam_search", "stream"),
    ({"n": 2, "best_of": 4, "stream": True}, "best_of", "stream"),
    ({"use_beam_search": True}, "use_beam_search", "width of 2"),
    ({"n": "3"}, "n", "integer"),
])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_choices_past_their_bounds_are_refused_by_field(fields, param, says, route, lm):
    body = {"model": "m", "max_tokens": 2, **fields}
    body |= {"messages": [{"role": "user", "content": "ab"}]} if "chat" in route else {"prompt": "ab"}
    if "chat" in route and "best_of" in fields:
        param, says = "best_of", ""  # the chat route has no best_of, as OpenAI's: an unknown field
    with client(lm) as http:
        reply = http.post(route, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_n_choices_within_the_bound_are_answered(lm):
    body = {"model": "m", "prompt": "ab", "max_tokens": 2, "n": 16, "temperature": 1.0, "seed": 3}
    with client(lm) as http:
        reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert [c["index"] for c in reply.json()["choices"]] == list(range(16))
