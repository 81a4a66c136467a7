"""Through the HTTP server, a request's tokens do not depend on what shares its steps: the same
completion alone, then 8 copies sent at staggered times, in every weight format, greedy and
seeded. (The GGUF mode serves the same int8/int4 kernels from GGUF blocks; it is not built
here.)"""

import copy

import httpx
import pytest
from conftest import MODEL, serving
from servers import staggered

from glassformer.accel import kernels
from glassformer.accel.quantize import quantize_model
from glassformer.language_model import LanguageModel
from glassformer.serving import EngineConfig
from glassformer.serving.api.app import ServerConfig

PROMPT = "The meaning of life is"
COPIES = 8


def _complete(url: str, body: dict) -> str:
    with httpx.Client(base_url=url, timeout=60) as http:
        reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels are not built")
@pytest.mark.parametrize("mode", ["none", "bf16", "int8", "int4"])
def test_eight_staggered_copies_equal_the_lone_answer(language_model, mode):
    model = quantize_model(copy.deepcopy(language_model.model), mode)
    served = LanguageModel(model, language_model.tokenizer, MODEL)
    bodies = {
        "greedy": {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0},
        "seeded": {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": 5},
    }
    with serving(served, ServerConfig(MODEL, max_tokens=64),
                 EngineConfig(n_blocks=256, max_batch=8, block_size=4, token_budget=16)) as (url, _):
        for kind, body in bodies.items():
            lone = _complete(url, body)
            answers = staggered(lambda body=body: _complete(url, body), COPIES, 0.015)
            differ = [i for i, answer in enumerate(answers) if answer != lone]
            assert not differ, f"{mode} {kind}: copies {differ} differ from the lone answer {lone!r}"
