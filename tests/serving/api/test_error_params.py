"""Every POST route's bad requests name the field that was sent wrong: one bad value at a time,
the error's `param` is that field's name in the body (built from the error's data, never from
its text). A plain ValueError from the library is a bug: 500, not 400."""

import dataclasses

import httpx
import pytest
from conftest import MODEL, serving

from glassformer.errors import InputError
from glassformer.serving.api.app import ROUTES, ServerConfig

C, CHAT = "/v1/completions", "/v1/chat/completions"
LOAD, UNLOAD, STEER = "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/steering_vectors"
D = 32  # the tiny model's d_model (checked below)


def completion(**changes):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4} | changes


def chat(**changes):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | changes


def glassformer(**fields):
    return completion(glassformer=fields)


def upload(**changes):
    return {"model": MODEL, "name": "v", "site": "blocks.0.resid_post", "vector": [0.1] * D} | changes


CASES = [  # (route, body, the param named)
    (C, completion(model=""), "model"),
    (C, completion(prompt=""), "prompt"),
    (C, completion(prompt=[100000]), "prompt"),
    (C, completion(prompt="a" * 200), "prompt"),
    (C, completion(max_tokens=0), "max_tokens"),
    (C, completion(max_tokens=100000), "max_tokens"),
    (C, completion(temperature=-1), "temperature"),
    (C, completion(temperature="hot"), "temperature"),
    (C, completion(top_p=0), "top_p"),
    (C, completion(top_k=0), "top_k"),
    (C, completion(min_p=2), "min_p"),
    (C, completion(presence_penalty=3), "presence_penalty"),
    (C, completion(frequency_penalty=-3), "frequency_penalty"),
    (C, completion(repetition_penalty=0), "repetition_penalty"),
    (C, completion(seed="x"), "seed"),
    (C, completion(stop=[""]), "stop"),
    (C, completion(stop=5), "stop"),
    (C, completion(n=17), "n"), (C, completion(n=2, best_of=1), "best_of"),
    (C, completion(stream="yes"), "stream"),
    (C, completion(logprobs=6), "logprobs"),
    (C, completion(echo=True), "echo"),
    (C, completion(suffix="x"), "suffix"),
    (C, completion(user=5), "user"),
    (C, glassformer(steer=[{"vector": "nope", "alpha": 1.0}]), "glassformer.steer"),
    (C, glassformer(steer=[{"vector": "v", "alpha": "x"}]), "glassformer.steer.0.alpha"),
    (C, glassformer(ablate=["blocks.0.attn.head.99"]), "glassformer.ablate"),
    (C, glassformer(ablate=["nope"]), "glassformer.ablate"),
    (C, glassformer(trace=["nope"]), "glassformer.trace"),
    (C, glassformer(lens={"top_k": 0}), "glassformer.lens.top_k"),
    (C, glassformer(lens={"layers": [99]}), "glassformer.lens.layers"),
    (C, glassformer(ignore_eos="yes"), "glassformer.ignore_eos"),
    (C, glassformer(ui=1), "glassformer.ui"),
    (CHAT, chat(messages=[]), "messages"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role"),
    (CHAT, chat(messages=[{"role": "user", "content": "a" * 300}]), "prompt"),
    (CHAT, chat(max_tokens=0), "max_tokens"),
    (CHAT, chat(max_completion_tokens=0), "max_completion_tokens"),
    (CHAT, chat(logprobs="yes"), "logprobs"),
    (CHAT, chat(top_logprobs=2), "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (CHAT, chat(temperature=-1), "temperature"),
    (CHAT, chat(stop=[""]), "stop"),
    (CHAT, chat(glassformer={"steer": [{"vector": "nope", "alpha": 1.0}]}), "glassformer.steer"),
    (LOAD, {"lora_name": "", "lora_path": "ADAPTERS/x"}, "lora_name"),
    (LOAD, {"lora_name": MODEL, "lora_path": "ADAPTERS/x"}, "lora_name"),
    (LOAD, {"lora_name": "a"}, "lora_path"),
    (LOAD, {"lora_name": "a", "lora_path": ""}, "lora_path"),
    (UNLOAD, {"lora_name": ""}, "lora_name"),
    (UNLOAD, {"lora_name": "never-loaded"}, "lora_name"),
    (STEER, upload(model=""), "model"),
    (STEER, upload(name="not a name!"), "name"),
    (STEER, upload(site="blocks.99.resid_post"), "site"),
    (STEER, upload(site="blocks.0.attn.pattern"), "site"),
    (STEER, upload(vector=[0.1] * (D + 1)), "vector"),
    (STEER, upload(vector=[]), "vector"),
]


@pytest.fixture(scope="module")
def client(language_model, tmp_path_factory):
    assert language_model.config.d_model == D
    config = ServerConfig(MODEL, max_tokens=64)
    adapters = tmp_path_factory.mktemp("adapters")
    if any(f.name == "lora_dirs" for f in dataclasses.fields(ServerConfig)):  # the routes on: their checks
        config = dataclasses.replace(config, lora_dirs=(str(adapters),))
    with serving(language_model, config) as (url, app), httpx.Client(base_url=url, timeout=30) as http:
        http.app, http.adapters = app, adapters
        yield http


def test_every_post_route_has_cases(client):
    posted = {route.path for route in client.app.routes if "POST" in getattr(route, "methods", ())}
    assert posted <= set(ROUTES)
    assert {route for route, _, _ in CASES} == posted


@pytest.mark.parametrize("route, body, param", CASES,
                         ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(CASES)])
def test_the_param_is_the_field_sent(client, route, body, param):
    if "lora_path" in body:
        body = body | {"lora_path": body["lora_path"].replace("ADAPTERS", str(client.adapters))}
    reply = client.post(route, json=body)
    assert 400 <= reply.status_code < 500, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["message"] and error["code"]


def test_an_input_error_from_the_engine_is_400_with_its_field(client, monkeypatch):
    def refuse(ids, params):
        raise InputError("temperature", "refused here", "odd_value")

    monkeypatch.setattr(client.app.state.server.engine, "submit", refuse)
    reply = client.post(C, json=completion())
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"] == {"message": "temperature: refused here", "type": "invalid_request_error",
                                     "param": "temperature", "code": "odd_value"}


@pytest.mark.parametrize("error", [ValueError("temperature: a bug"), KeyError("temperature"),
                                   RuntimeError("a bug")])
def test_any_other_error_from_the_engine_is_a_500(client, monkeypatch, error):
    def fail(ids, params):
        raise error

    monkeypatch.setattr(client.app.state.server.engine, "submit", fail)
    reply = client.post(C, json=completion())
    assert reply.status_code == 500, reply.text
    body = reply.json()["error"]
    assert body["type"] == "server_error" and body["code"] == "internal_error" and body["param"] is None
    assert reply.headers["connection"] == "close"  # the HTTP server ends the connection after it
    assert "a bug" not in body["message"]
    monkeypatch.undo()
    assert client.post(C, json=completion()).status_code == 200  # and it serves on
