"""Steering, head ablation and the lens per request over the API, against the module path run
alone with the same change; and every bad input answered 4xx in OpenAI's error shape."""

import json

import httpx
import pytest
import torch
from conftest import serving

from glassformer.generation.config import Steer
from glassformer.interpret.lens import logit_lens
from glassformer.interpret.steer import steered
from glassformer.serving.api.app import ServerConfig

MODEL = "tiny"


def _vector(d, seed=5):
    return (3 * torch.randn(d, generator=torch.Generator().manual_seed(seed))).tolist()


def _greedy_tokens(language_model, prompt, n, **change):
    """n greedy tokens of the module path alone, steered / ablated by interpret.steer.steered."""
    model = language_model.model
    ids = language_model.encode(prompt)
    with steered(model, **change), torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[-n:]


def _complete(client, prompt, **glassformer):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "glassformer": {"ignore_eos": True, **glassformer}}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_steered_and_ablated_requests_equal_the_module_path_alone(client, language_model):
    model = language_model.model
    vector = _vector(model.config.d_model)
    upload = {"model": MODEL, "name": "up", "site": "blocks.0.resid_post", "vector": vector}
    assert client.post("/v1/steering_vectors", json=upload).status_code == 200
    assert [v["id"] for v in client.get("/v1/steering_vectors").json()["data"]] == ["up"]
    prompt, tokenizer = "the cat sat", language_model.tokenizer
    reply = _complete(client, prompt, steer=[{"vector": "up", "alpha": 1.5}])
    expected = _greedy_tokens(language_model, prompt, 6,
                              steers=[Steer("blocks.0.resid_post", torch.tensor(vector), 1.5)])
    assert reply["choices"][0]["text"] == tokenizer.decode(expected)
    assert expected != _greedy_tokens(language_model, prompt, 6)
    ablated = _complete(client, prompt, ablate=["blocks.1.attn.head.0"])
    expected = _greedy_tokens(language_model, prompt, 6, ablate=["blocks.1.attn.head.0"])
    assert ablated["choices"][0]["text"] == tokenizer.decode(expected)


def test_lens_per_request_equals_logit_lens_alone(client, language_model):
    prompt = "a dog ran"
    reply = _complete(client, prompt, lens={"top_k": 3})
    lens = reply["glassformer"]["lens"]
    ids = language_model.encode(prompt) + language_model.tokenizer.encode(reply["choices"][0]["text"])[:-1]
    alone = logit_lens(language_model.model, torch.tensor([ids]), top_k=3)
    assert lens["ids"] == ids and len(lens["layers"]) == language_model.config.n_layers + 1
    rows = zip(lens["layers"], alone.sites, alone.ids, alone.probs, strict=True)
    for layer, site, top_ids, top_probs in rows:
        assert layer["site"] == site
        assert [[t["id"] for t in top] for top in layer["top"]] == top_ids[0].tolist()
        got = torch.tensor([[t["prob"] for t in top] for top in layer["top"]])
        torch.testing.assert_close(got, top_probs[0], atol=6e-5, rtol=0)  # sent rounded to 4 places


def _refused(reply, status, param_start):
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"] or "").startswith(param_start)


def test_bad_steering_lens_and_capture_requests_get_4xx(language_model):
    d = language_model.config.d_model
    config = ServerConfig(MODEL, api_key="key", max_tokens=64, max_capture_mb=0.01)
    with serving(language_model, config) as (url, _), httpx.Client(base_url=url, timeout=30) as http:
        auth = {"Authorization": "Bearer key"}
        upload = {"model": MODEL, "name": "v", "site": "blocks.0.resid_post", "vector": _vector(d)}
        _refused(http.post("/v1/steering_vectors", json=upload), 401, "")
        _refused(http.post("/v1/steering_vectors", json=upload | {"vector": [1.0] * (d + 1)}, headers=auth),
                 400, "vector")
        _refused(http.post("/v1/steering_vectors", json=upload | {"site": "blocks.9.resid_post"},
                           headers=auth), 400, "site")
        assert http.post("/v1/steering_vectors", json=upload, headers=auth).status_code == 200

        def ask(max_tokens=4, **glassformer):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "glassformer": glassformer}
            text = json.dumps(body).replace('"ALPHA"', "1e999")  # JSON's largest float overflows
            kind = {"Content-Type": "application/json"}
            return http.post("/v1/completions", content=text, headers=auth | kind)

        _refused(ask(steer=[{"vector": "v", "alpha": "ALPHA"}]), 400, "glassformer.steer.0.alpha")
        _refused(ask(steer=[{"vector": "nope", "alpha": 1.0}]), 400, "glassformer.steer")
        for site in ("blocks.9.resid_post", "blocks.0.attn.q"):
            _refused(ask(steer=[{"vector": "v", "site": site, "alpha": 1.0}]), 400, "glassformer.steer")
        _refused(ask(ablate=["blocks.0.attn.head.99"]), 400, "glassformer.ablate")
        _refused(ask(lens={"top_k": 0}), 400, "glassformer.lens.top_k")
        _refused(ask(60, trace=["blocks.0.attn.pattern"]), 400, "glassformer")  # 4 heads x 62² floats
        assert ask(4, trace=["blocks.0.attn.pattern"]).status_code == 200
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "glassformer": {"steer": []}}
        _refused(http.post("/v1/completions", json=body), 401, "")
        reply = ask(steer=[{"vector": "v", "alpha": 1.0}], lens={"top_k": 1})
        assert reply.status_code == 200 and "lens" in reply.json()["glassformer"]


@pytest.mark.parametrize("size", [-1.0, float("inf"), True])
def test_max_capture_mb_is_a_finite_size_of_at_least_zero(size):
    with pytest.raises(ValueError, match="^max_capture_mb: "):
        ServerConfig(MODEL, max_capture_mb=size)


def test_max_capture_mb_zero_refuses_every_trace_and_lens(language_model):
    config = ServerConfig(MODEL, max_tokens=64, max_capture_mb=0)
    with serving(language_model, config) as (url, _), httpx.Client(base_url=url, timeout=30) as http:
        def ask(**glassformer):
            return http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                      "glassformer": glassformer})

        for refused in (ask(trace=["blocks.0.resid_post"]), ask(lens={"top_k": 1}),
                        ask(trace=["embed.out"], lens={"top_k": 5})):
            _refused(refused, 400, "glassformer")
            assert refused.json()["error"]["code"] == "capture_disabled"
        plain = ask(ignore_eos=True)
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 2
        assert "glassformer" not in plain.json()
