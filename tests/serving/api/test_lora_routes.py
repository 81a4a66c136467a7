"""LoRA adapters over HTTP: loaded and unloaded at run time (from the folders the server names,
behind the API key when one is set), picked by a request's `model`, listed by /v1/models; an
adapter's answer is the merged model's, the base's is the plain model's; bad adapters and names
are 4xx in OpenAI's shape."""

from __future__ import annotations

import copy

import httpx
import pytest
import torch
from conftest import MODEL, serving

from glassformer.language_model import LanguageModel
from glassformer.serving.api.app import ServerConfig
from glassformer.training.lora import LoRAConfig, add_lora, merge_lora, save_adapter

KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def adapter(language_model, tmp_path_factory):
    """A PEFT adapter folder for the tiny model (random A and B) and the merged model."""
    wrapped = copy.deepcopy(language_model.model)
    config = LoRAConfig(2, 4.0)
    add_lora(wrapped, config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    folder = tmp_path_factory.mktemp("adapter")
    save_adapter(folder, wrapped, config, "")
    return folder, LanguageModel(merge_lora(wrapped), language_model.tokenizer)


def complete(http, model: str, headers=None) -> httpx.Response:
    return http.post("/v1/completions", headers=headers or {},
                     json={"model": model, "prompt": "hello there", "max_tokens": 6, "temperature": 0})


def test_adapters_load_serve_and_unload(language_model, adapter):
    folder, merged = adapter
    config = ServerConfig(MODEL, max_tokens=64, lora_dirs=(str(folder.parent),))  # runtime loads on
    with serving(language_model, config) as (url, _), httpx.Client(base_url=url, timeout=30) as http:
        load = {"lora_name": "mine", "lora_path": str(folder)}
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 200
        models = http.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == [MODEL, "mine"] and models[1]["parent"] == MODEL
        assert complete(http, "mine").json()["choices"][0]["text"] == \
            merged.generate("hello there", max_new_tokens=6).text
        assert complete(http, MODEL).json()["choices"][0]["text"] == \
            language_model.generate("hello there", max_new_tokens=6).text
        for body, status, param in (
                (load, 400, "lora_name"),  # loaded already
                ({"lora_name": MODEL, "lora_path": str(folder)}, 400, "lora_name"),
                ({"lora_name": "x", "lora_path": str(folder / "missing")}, 400, "lora_path"),
                ({"lora_name": "x"}, 400, "lora_path")):
            reply = http.post("/v1/load_lora_adapter", json=body)
            assert reply.status_code == status and reply.json()["error"]["param"] == param, reply.text
        traced = http.post("/v1/completions", json={"model": "mine", "prompt": "hi", "max_tokens": 2,
                                                    "glassformer": {"trace": ["blocks.0.attn.pattern"]}})
        assert traced.status_code == 400 and "with a LoRA adapter" in traced.json()["error"]["message"]
        unknown = complete(http, "x")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mine"}).status_code == 200
        assert complete(http, "mine").status_code == 404
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "mine"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "adapter_not_found"
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]


def test_adapter_routes_need_the_api_key(language_model, adapter):
    folder, _ = adapter
    config = ServerConfig(MODEL, api_key="s3cret", max_tokens=8, lora_dirs=(str(folder),))
    with serving(language_model, config) as (url, _), httpx.Client(base_url=url, timeout=30) as http:
        load, unload = {"lora_name": "mine", "lora_path": str(folder)}, {"lora_name": "mine"}
        for path, body in (("/v1/load_lora_adapter", load), ("/v1/unload_lora_adapter", unload)):
            reply = http.post(path, json=body)
            assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
        assert http.post("/v1/load_lora_adapter", json=load, headers=KEY).status_code == 200
        assert complete(http, "mine", KEY).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json=unload, headers=KEY).status_code == 200
