"""Several choices per request: `n` (each choice its own engine request, with a seed derived
from the request's), `best_of` (the n candidates of highest log-probability) and
`use_beam_search` (the engine's beam search), streamed and whole; a client that leaves
cancels every choice."""

import json
import time

import httpx
import torch
from conftest import serving

from glassformer.generation.config import GenerationConfig
from glassformer.generation.generate import generate
from glassformer.serving import EngineConfig
from glassformer.serving.api.app import ServerConfig
from glassformer.serving.api.choices import derived_seed

MODEL = "tiny"
SAMPLED = {"model": MODEL, "prompt": "hello", "max_tokens": 6, "temperature": 1.0, "seed": 7,
           "glassformer": {"ignore_eos": True}}


def test_n_choices_are_the_single_requests_with_derived_seeds(client):
    reply = client.post("/v1/completions", json=SAMPLED | {"n": 3}).json()
    singles = [client.post("/v1/completions", json=SAMPLED | {"seed": derived_seed(7, i)}).json()
               for i in range(3)]
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert [c["text"] for c in reply["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert len({c["text"] for c in reply["choices"]}) > 1  # sampled with different seeds
    assert reply["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"] == 5
    assert reply["usage"]["completion_tokens"] == 3 * 6
    again = client.post("/v1/completions", json=SAMPLED | {"n": 3}).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in reply["choices"]]


def test_greedy_choices_are_equal(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "temperature": 0, "n": 4}
    reply = client.post("/v1/chat/completions", json=body).json()
    texts = [c["message"]["content"] for c in reply["choices"]]
    single = client.post("/v1/chat/completions", json=body | {"n": 1}).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    assert texts == [single["choices"][0]["message"]["content"]] * 4


def test_a_stream_of_choices_carries_each_index_and_ends_with_usage(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "temperature": 1.0, "seed": 3, "n": 3, "glassformer": {"ignore_eos": True}}
    whole = client.post("/v1/chat/completions", json=body).json()
    texts, finishes, usage = {}, {}, None
    with client.stream("POST", "/v1/chat/completions",
                       json=body | {"stream": True, "stream_options": {"include_usage": True}}) as reply:
        lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    for chunk in map(json.loads, lines[:-1]):
        if chunk.get("usage"):
            usage = chunk["usage"]
            continue
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["delta"].get("content", "")
            if choice["finish_reason"] is not None:
                finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage == whole["usage"] and usage["completion_tokens"] == 3 * 6


def test_best_of_returns_the_likeliest_candidates(client):
    reply = client.post("/v1/completions", json=SAMPLED | {"n": 2, "best_of": 5}).json()
    candidates = []
    for i in range(5):  # each candidate alone, with its log-probabilities
        alone = client.post("/v1/completions", json=SAMPLED | {"seed": derived_seed(7, i), "logprobs": 0})
        choice = alone.json()["choices"][0]
        candidates.append((sum(choice["logprobs"]["token_logprobs"]), choice["text"]))
    candidates.sort(key=lambda c: -c[0])
    assert len({text for _, text in candidates}) > 2
    assert [c["text"] for c in reply["choices"]] == [text for _, text in candidates[:2]]
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in reply["choices"])  # not asked for
    assert reply["usage"]["completion_tokens"] == 5 * 6  # every candidate generated


def test_beam_search_answers_the_engines_best_beam(client, language_model):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 6, "temperature": 0,
            "use_beam_search": True, "best_of": 3, "glassformer": {"ignore_eos": True}}
    reply = client.post("/v1/completions", json=body).json()
    ids = language_model.tokenizer.encode("hello")
    want = generate(language_model.model, ids, GenerationConfig(max_new_tokens=6, beams=3, eos_ids=()),
                    language_model.tokenizer)
    assert [c["text"] for c in reply["choices"]] == [want.text]
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 6


def test_beam_choices_are_the_n_best_beams(client, language_model):
    """Over two tokens a beam of width W keeps the W likeliest first tokens, then answers the
    likeliest of their W x V continuations: computed here from one forward over all of them."""
    width, n = 16, 5
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0, "n": n,
            "use_beam_search": True, "best_of": width, "glassformer": {"ignore_eos": True}}
    reply = client.post("/v1/completions", json=body).json()
    model, tokenizer = language_model.model, language_model.tokenizer
    prompt = torch.tensor(tokenizer.encode("hello"))
    with torch.no_grad():
        first = model(prompt[None])[0, -1].float().log_softmax(-1)  # (V,)
        kept = first.topk(width).indices  # (W,)
        rows = torch.cat((prompt.expand(width, -1), kept[:, None]), dim=1)  # (W, T + 1)
        second = model(rows)[:, -1].float().log_softmax(-1)  # (W, V)
    totals = first[kept][:, None] + second  # (W, V)
    best = totals.flatten().topk(n).indices
    texts = [tokenizer.decode([int(kept[i // totals.shape[1]]), int(i % totals.shape[1])]) for i in best]
    assert [c["text"] for c in reply["choices"]] == texts
    assert [c["index"] for c in reply["choices"]] == list(range(n))
    assert reply["usage"]["completion_tokens"] == 2 * n


def test_a_client_that_leaves_cancels_every_choice(language_model):
    config = ServerConfig(MODEL, max_tokens=100, max_queue=4)
    with serving(language_model, config, EngineConfig(n_blocks=64, max_batch=4)) as (url, app):
        server = app.state.server
        run = server.engine.runner.run

        def slowed(plan):
            time.sleep(0.02)
            return run(plan)

        server.engine.runner.run = slowed
        body = SAMPLED | {"n": 3, "max_tokens": 100, "stream": True}
        with httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as reply:
                lines = reply.iter_lines()  # kept: a line iterator collected closes the connection
                assert next(lines).startswith("data: ")
                assert len(server.active) == 3  # every choice runs while the client reads
            deadline = time.monotonic() + 5
            while (server.active or server.engine.blocks.free_count < 64) and time.monotonic() < deadline:
                time.sleep(0.02)
        assert not server.active
        assert server.engine.blocks.free_count == 64
        assert server.engine.stats.tokens_generated < 3 * 50
