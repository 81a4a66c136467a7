"""Trace sites on the serving path: the tensors a request gets back equal `run_with_cache` on
that request alone, while other requests run beside it."""

import asyncio

import httpx
import torch

from glassformer.interpret.trace import run_with_cache
from glassformer.serving.api.tracing import Tracer, answer_bytes

MODEL = "tiny"
SITES = ["blocks.0.attn.pattern", "blocks.1.resid_post", "logits"]


def test_traced_tensors_equal_run_with_cache_alone(base_url, language_model):
    traced = {"model": MODEL, "prompt": "the cat sat", "max_tokens": 6, "temperature": 0,
              "glassformer": {"trace": SITES, "ignore_eos": True}}
    others = [{"model": MODEL, "prompt": p, "max_tokens": 20, "temperature": 0}
              for p in ("hello world", "a dog ran in the park", "x")]

    async def main():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            streamed = {**traced, "stream": True}

            async def last_chunk():
                async with http.stream("POST", "/v1/completions", json=streamed) as reply:
                    return [line async for line in reply.aiter_lines() if line.startswith("data: {")][-1]

            replies = await asyncio.gather(http.post("/v1/completions", json=traced), last_chunk(),
                                           *(http.post("/v1/completions", json=o) for o in others))
            return replies[0].json(), httpx.Response(200, content=replies[1][6:]).json()

    whole, final_chunk = asyncio.run(main())
    ids = language_model.encode("the cat sat")
    generated = language_model.tokenizer.encode(whole["choices"][0]["text"])
    assert len(generated) == 6
    _, alone = run_with_cache(language_model.model, torch.tensor([ids + generated[:-1]]), SITES)
    for reply in (whole, final_chunk):
        trace = reply["glassformer"]["trace"]
        assert sorted(trace) == sorted(SITES)
        for site in SITES:
            torch.testing.assert_close(torch.tensor(trace[site]), alone[site][0], atol=1e-5, rtol=1e-5)
    assert final_chunk["choices"][0]["finish_reason"] == "length"


def test_unknown_site_is_400(client):
    reply = client.post("/v1/completions", json={"model": MODEL, "prompt": "a",
                                                 "glassformer": {"trace": ["blocks.99.attn.pattern"]}})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "glassformer.trace"
    assert "blocks.99.attn.pattern" in reply.json()["error"]["message"]


def test_the_tracers_twin_never_runs_the_engines_hooks(language_model):
    """The twin is made while a step of the engine may hold its capture hooks on the model's
    registry (shared with the engine): it starts with a registry of its own, empty, so a
    trace never hands its tensors to another request's capture."""
    engine_step = []
    tracer = Tracer(language_model.model)
    ids = language_model.encode("the cat")
    with language_model.model.hooks.installed({"blocks.1.resid_post": lambda t, site: engine_step.append(t)}):
        tracer.run(ids, ["logits"])  # the twin is made here, mid-step
    tracer.run(ids, ["logits"])
    assert engine_step == []


def test_the_lens_bound_counts_the_chosen_layers(language_model):
    config = language_model.config
    one, two, every = (answer_bytes(config, (), 5, 10, layers) for layers in ((0,), (0, 2), None))
    assert every - one == config.n_layers * (two - one) > 0
