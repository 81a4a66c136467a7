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
