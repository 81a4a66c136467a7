"""The server on a GPU (marked cuda, skipped without one), as `serve --deterministic` runs it:
a greedy completion over HTTP equals `generate` on the same model and device, and is the same
text while seven other requests share its steps."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from conftest import MODEL, serving

from glassformer.accel.precision import CUBLAS_WORKSPACE, choose_precision, use_precision
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.language_model import LanguageModel
from glassformer.serving import EngineConfig

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.fixture
def on_cuda(language_model, monkeypatch):
    """The tiny model on the GPU, the process set up as --deterministic does (restored after)."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32,
              torch.backends.cudnn.allow_tf32)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    use_precision(choose_precision("cuda", deterministic=True))
    yield LanguageModel(copy.deepcopy(language_model.model).to("cuda"), language_model.tokenizer, MODEL)
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[1:]


def test_a_completion_over_http_equals_generate_alone_and_beside_others(on_cuda):
    prompt, others = "the cat sat", ["a", "hello there, how are you", "xyz", "the dog", "ok then",
                                     "numbers 12345", "Zebra."]
    want = generate(on_cuda.model, on_cuda.encode(prompt),
                    GenerationConfig(max_new_tokens=12, eos_ids=()), on_cuda.tokenizer).text
    engine = EngineConfig(n_blocks=256, max_batch=8, deterministic=True)
    with serving(on_cuda, engine=engine) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        def complete(text: str, temperature: float = 0.0) -> str:
            body = {"model": MODEL, "prompt": text, "max_tokens": 12, "temperature": temperature,
                    "seed": 1, "glassformer": {"ignore_eos": True}}
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]

        alone = complete(prompt)
        with ThreadPoolExecutor(8) as pool:
            shared = pool.submit(complete, prompt)
            list(pool.map(complete, others, [0.8] * len(others)))
            together = shared.result()
    assert alone == together == want
