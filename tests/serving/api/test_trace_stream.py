"""Trace sites streamed token by token: each chunk carries the rows the engine computed since the
previous one; together they are the answer's trace, and a request that asks nothing streams
what it streams alone, without them. (That its numbers are bitwise those of the same step
without any capture is tests/serving/test_capture.py's.)"""

import asyncio
import json

import httpx
import torch

MODEL = "tiny"
SITES = ["embed.out", "blocks.0.attn.q", "blocks.1.resid_post"]
AXIS = {"embed.out": 0, "blocks.0.attn.q": 1, "blocks.1.resid_post": 0}  # pos, batch dropped
PROMPT = "the cat sat"


async def _chunks(http: httpx.AsyncClient, body: dict) -> list[dict]:
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        return [json.loads(line[6:]) async for line in reply.aiter_lines() if line.startswith("data: {")]


def test_streamed_rows_are_the_answers_trace(base_url, language_model):
    traced = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
              "glassformer": {"trace": SITES, "ignore_eos": True}}
    plain = {"model": MODEL, "prompt": "a dog ran", "max_tokens": 8, "temperature": 0, "logprobs": 2,
             "glassformer": {"ignore_eos": True}}

    async def main():
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            alone = await _chunks(http, plain)
            together = await asyncio.gather(http.post("/v1/completions", json=traced), _chunks(http, traced),
                                            _chunks(http, plain), _chunks(http, {**traced, "glassformer": {
                                                "trace": SITES, "ignore_eos": True, "ui": True}}))
            return alone, together[0].json(), *together[1:]

    alone, whole, streamed, beside, watched = asyncio.run(main())
    n_prompt = len(language_model.encode(PROMPT))
    for chunks in (streamed, watched):
        tokens, last = chunks[:-1], chunks[-1]
        assert len(tokens) == 6 and last["choices"][0]["finish_reason"] == "length"
        assert [len(c["glassformer"]["trace"]["embed.out"]) for c in tokens] == [n_prompt] + [1] * 5
        assert sorted(last["glassformer"]["trace"]) == sorted(SITES)  # (the ui's own sites stay out)
        for site in SITES:
            rows = torch.cat([torch.tensor(c["glassformer"]["trace"][site]) for c in tokens], dim=AXIS[site])
            assert torch.equal(rows, torch.tensor(last["glassformer"]["trace"][site]))
            torch.testing.assert_close(rows, torch.tensor(whole["glassformer"]["trace"][site]),
                                       atol=1e-5, rtol=1e-5)
        assert all(set(c["glassformer"]["trace"]) == set(SITES) for c in tokens)
    assert [c["choices"][0]["text"] for c in beside] == [c["choices"][0]["text"] for c in alone]
    logprobs = [torch.tensor([c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks[:-1]])
                for chunks in (beside, alone)]
    torch.testing.assert_close(*logprobs, atol=1e-5, rtol=1e-5)
    assert all("glassformer" not in c for c in beside)
