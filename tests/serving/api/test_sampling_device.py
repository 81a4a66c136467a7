"""Sampling on the model's device: each request's generator and token counts live where the
runner computes, draws reach the host once per step, and sampled requests over HTTP answer
200 on every device there is (the CUDA case is marked `cuda` and skipped without a GPU)."""

import copy

import httpx
import pytest
import torch
from conftest import MODEL, serving

from glassformer.generation.generate import GenerationConfig, generate
from glassformer.generation.sampling import SamplingConfig
from glassformer.language_model import LanguageModel
from glassformer.serving import Engine, EngineConfig, RequestParams, sampler

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])]
SAMPLED = SamplingConfig(temperature=1.0, top_k=20, repetition_penalty=1.2)


def _on(language_model: LanguageModel, device: str) -> LanguageModel:
    model = copy.deepcopy(language_model.model).to(device)
    return LanguageModel(model, language_model.tokenizer, MODEL)


@pytest.mark.parametrize("device", DEVICES)
def test_each_request_draws_on_the_runners_device_as_generate_does(language_model, device, monkeypatch):
    model = _on(language_model, device).model
    engine = Engine(model, None, EngineConfig(n_blocks=64))
    seen = []
    draw = sampler.draw

    def recorded(seq, logits):
        seen.append((seq.generator.device.type, seq.counts.device.type, logits.device.type))
        return draw(seq, logits)

    monkeypatch.setattr(sampler, "draw", recorded)
    prompt = [5, 9, 2, 33, 7]
    handle = engine.submit(prompt, RequestParams(max_new_tokens=8, eos_ids=(), seed=3, sampling=SAMPLED))
    engine.run_until_done()
    assert seen and set(seen) == {(device, device, device)}
    alone = generate(model, prompt,
                     GenerationConfig(max_new_tokens=8, eos_ids=(), seed=3, sampling=SAMPLED))
    assert handle.result.generated_ids == alone.generated_ids  # the same seed, the same draws


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_requests_over_http_answer_200(language_model, device):
    with serving(_on(language_model, device)) as (url, _):
        with httpx.Client(base_url=url, timeout=60) as client:
            for body in ({"model": MODEL, "prompt": "the cat", "max_tokens": 8},
                         {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                          "temperature": 0.8, "seed": 1}):
                route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                reply = client.post(route, json=body)
                assert reply.status_code == 200, reply.text
