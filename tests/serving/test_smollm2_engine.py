"""SmolLM2-135M-Instruct through the engine: greedy fp32 tokens equal `generate`'s."""

from __future__ import annotations

import pytest

from glassformer import load
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.serving import Engine, EngineConfig, RequestParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load(str(smollm2_path), quantize="none", progress=False)


def test_greedy_fp32_engine_equals_generate(smollm2):
    prompts = [smollm2.tokenizer.encode(text) for text in
               ("The meaning of life is", "Once upon a time, in a small village,", "def fibonacci(n):")]
    expected = [generate(smollm2.model, p, GenerationConfig(max_new_tokens=24, eos_ids=())).generated_ids
                for p in prompts]
    engine = Engine(smollm2.model, smollm2.tokenizer, EngineConfig(kv_memory_mb=32))
    handles = [engine.submit(p, RequestParams(max_new_tokens=24, eos_ids=())) for p in prompts]
    engine.run_until_done()
    assert [h.wait(0).generated_ids for h in handles] == expected


def _logprobs(smollm2, prompts, config, arrivals):
    """Each request's generated tokens' log-probabilities, request i submitted before step
    arrivals[i]."""
    engine = Engine(smollm2.model, smollm2.tokenizer, config)
    params = RequestParams(max_new_tokens=6, eos_ids=(), logprobs=0)
    handles, step = {}, 0
    while len(handles) < len(prompts) or engine.has_work():
        for i, prompt in enumerate(prompts):
            if arrivals[i] == step:
                handles[i] = engine.submit(prompt, params)
        engine.step()
        step += 1
    return [[e.logprobs.logprob for e in handles[i] if e.token_id is not None] for i in range(len(prompts))]


TEXT = ("A paged cache keeps each request's keys and values in blocks of sixteen tokens. The scheduler "
        "gives every step a budget of tokens; a long prompt is cut into chunks that share steps with "
        "requests already decoding, and each chunk attends to the blocks its request has filled. ") * 6


def test_fast_attention_numbers_do_not_depend_on_where_the_budget_cuts_a_prompt(smollm2):
    """Prompts of 37-83 tokens through a 24-token budget while others decode: every
    log-probability bit for bit that of the request alone (an unaligned cut moves them)."""
    ids = smollm2.tokenizer.encode(TEXT)
    prompts = [ids[start : start + n] for start, n in ((0, 83), (100, 37), (200, 61), (300, 50))]
    config = EngineConfig(kv_memory_mb=32, token_budget=24, max_batch=4)
    alone = [_logprobs(smollm2, [p], config, [0])[0] for p in prompts]
    assert _logprobs(smollm2, prompts, config, [0, 1, 3, 4]) == alone
