import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.generation.config import RequestParams
from glassformer.generation.sampling import SamplingConfig
from glassformer.serving import Engine, EngineConfig


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread (two cost more in synchronisation than they save)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny():
    """A tiny Llama-shaped model whose large init spreads the logits (clear argmaxes)."""

    def build(name: str = "tiny-llama", **changes) -> Transformer:
        torch.manual_seed(0)
        return Transformer(get_preset(name).replace(init_std=0.3, context_length=64, **changes)).eval()

    return build


@pytest.fixture
def prompts():
    """Random token prompts of the given lengths."""

    def make(lengths, seed: int = 1, vocab: int = 96) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]

    return make


@pytest.fixture
def mixed_requests(prompts):
    """Eight requests of different lengths and settings (greedy and seeded sampling, with
    log-probabilities), each asking new_tokens + 0..2 tokens; the first is the one watched."""

    def make(new_tokens: int) -> list[tuple[list[int], RequestParams]]:
        asked = prompts([5, 11, 3, 17, 8, 2, 13, 6], seed=4)
        sampled = SamplingConfig(temperature=0.9, top_k=20)
        return [(p, RequestParams(max_new_tokens=new_tokens + i % 3, eos_ids=(), logprobs=0, seed=i,
                                  sampling=sampled if i % 2 else SamplingConfig()))
                for i, p in enumerate(asked)]

    return make


@pytest.fixture
def run_in_turn():
    """Requests through an engine, each submitted one step after the previous and the prompts'
    prefill chunked: their results, in order."""

    def run(model, prompts, params, attention="fast"):
        engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=64, token_budget=8, max_batch=4,
                                                  attention=attention))
        handles = []
        for prompt, p in zip(prompts, params, strict=True):
            handles.append(engine.submit(prompt, p))
            engine.step()
        engine.run_until_done()
        return [h.wait(0) for h in handles]

    return run
