"""A bounded load test on loopback: 16 clients send 64 requests (streamed and whole, greedy and
seeded sampling, varied prompts and lengths); every one completes with a finish_reason, none
gets a 5xx, and each output equals that request run alone through `generate`."""

import asyncio
import json
import random

import httpx

from glassformer.generation.generate import GenerationConfig, generate
from glassformer.generation.sampling import SamplingConfig

MODEL = "tiny"
CLIENTS, REQUESTS = 16, 64
WORDS = "the cat sat on a mat and the dog ran in the park while hello world".split()


def make_requests() -> list[dict]:
    rng = random.Random(0)
    requests = []
    for i in range(REQUESTS):
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(1, 40), "stream": i % 2 == 0}
        body |= {"temperature": 0.8, "top_k": 20, "seed": i} if i % 3 == 0 else {"temperature": 0}
        requests.append(body)
    return requests


def alone(language_model, body) -> str:
    sampling = SamplingConfig(temperature=body["temperature"], top_k=body.get("top_k"))
    config = GenerationConfig(max_new_tokens=body["max_tokens"], sampling=sampling, seed=body.get("seed"))
    return generate(language_model.model, language_model.encode(body["prompt"]), config,
                    language_model.tokenizer).text


async def send(http: httpx.AsyncClient, body: dict) -> tuple[int, str, str | None]:
    if not body["stream"]:
        reply = await http.post("/v1/completions", json=body)
        if reply.status_code != 200:
            return reply.status_code, reply.text, None
        choice = reply.json()["choices"][0]
        return 200, choice["text"], choice["finish_reason"]
    text, finish, done = [], None, False
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            return reply.status_code, (await reply.aread()).decode(), None
        async for line in reply.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            text.append(choice["text"])
            finish = finish or choice["finish_reason"]
    assert done, "the stream ended without data: [DONE]"
    return 200, "".join(text), finish


def test_sixteen_clients_sixty_four_requests(base_url, language_model):
    requests = make_requests()
    expected = [alone(language_model, body) for body in requests]

    async def main():
        queue = asyncio.Queue()
        for i in range(REQUESTS):
            queue.put_nowait(i)
        results = [None] * REQUESTS

        async def client():
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
                while not queue.empty():
                    i = queue.get_nowait()
                    results[i] = await send(http, requests[i])

        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(CLIENTS))), 240)
        return results

    results = asyncio.run(main())
    for i, (status, text, finish) in enumerate(results):
        assert status == 200, (i, text)
        assert finish in ("stop", "length"), i
        assert text == expected[i], i
