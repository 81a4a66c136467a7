"""The engine under the sink policy against `generate` under it (the oracle)."""

import pytest
import torch

from glassformer import ModelConfig, Transformer
from glassformer.accel.quantize import quantize_model
from glassformer.generation.config import GenerationConfig
from glassformer.generation.generate import generate
from glassformer.generation.sampling import SamplingConfig
from glassformer.model.sink import SinkPolicy
from glassformer.serving import Engine, EngineConfig, RequestParams

POLICY = SinkPolicy(3, 6)
SAMPLED = {"max_new_tokens": 30, "eos_ids": (), "seed": 5, "sampling": SamplingConfig(temperature=1.0)}


def _model(position="rope"):
    torch.manual_seed(1)
    config = ModelConfig(vocab_size=53, context_length=32, d_model=32, n_layers=2, n_heads=4,
                         n_kv_heads=2, position=position, norm="rmsnorm", activation="silu", gated=True,
                         init_std=0.3)
    return Transformer(config).eval()


def _prompts():
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(0, 53, (n,), generator=generator).tolist() for n in (4, 13, 40)]


@pytest.mark.parametrize("position", ["rope", "alibi"])
@pytest.mark.parametrize("attention, block_size", [("fast", 2), ("fast", 4), ("reference", 4)])
def test_engine_matches_generate_with_sinks(position, attention, block_size):
    model = _model(position)
    prompts = _prompts()  # the last one is longer than the model's window
    want = [generate(model, p, GenerationConfig(**SAMPLED, sink=POLICY)).generated_ids for p in prompts]
    engine = Engine(model, None, EngineConfig(block_size=block_size, n_blocks=16, attention=attention,
                                              token_budget=16, sink=POLICY))
    handles = [engine.submit(p, RequestParams(**SAMPLED)) for p in prompts]
    engine.run_until_done()
    assert [h.wait().generated_ids for h in handles] == want
    full = generate(model, prompts[1], GenerationConfig(**SAMPLED, overflow="slide"))
    assert full.generated_ids != want[1]  # the policy changes what the model sees


def test_a_converted_model_takes_the_module_path():
    model = quantize_model(_model(), "int8")  # its fused step is refused for sink requests
    prompt = _prompts()[2]
    want = generate(model, prompt, GenerationConfig(max_new_tokens=20, eos_ids=(), sink=POLICY))
    engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=8, sink=POLICY))
    handle = engine.submit(prompt, RequestParams(max_new_tokens=20, eos_ids=()))
    engine.run_until_done()
    assert handle.wait().generated_ids == want.generated_ids


def test_a_request_holds_the_blocks_of_its_window_only():
    engine = Engine(_model(), None, EngineConfig(block_size=4, n_blocks=3, sink=POLICY))
    handle = engine.submit(list(range(50)), RequestParams(max_new_tokens=60, eos_ids=()))
    while engine.has_work():
        engine.step()
        assert engine.blocks.used <= 3  # ceil((3 + 6) / 4)
    assert handle.wait().stop_reason == "max_new_tokens"


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match="^position: "):
        Engine(_model("learned"), None, EngineConfig(sink=POLICY))
    with pytest.raises(ValueError, match="^window: "):
        Engine(_model(), None, EngineConfig(sink=SinkPolicy(4, 29)))
    engine = Engine(_model(), None, EngineConfig(sink=POLICY))
    with pytest.raises(ValueError, match="^beams: "):
        engine.submit([1, 2], RequestParams(beams=2))


def test_a_prompt_past_the_window_enters_in_chunks_as_streaming_reads_it():
    """The engine's chunks past the window (model/sink_chunk.py) against streaming, a token a
    step: every token and its log-probability."""
    prompt, params = _prompts()[2], RequestParams(max_new_tokens=12, eos_ids=(), logprobs=0)
    runs = {}
    for chunk in (1, 5):
        engine = Engine(_model(), None, EngineConfig(block_size=4, n_blocks=8, token_budget=16,
                                                     sink=SinkPolicy(3, 6, chunk)))
        handle = engine.submit(prompt, params)
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        runs[chunk] = [(e.token_id, e.logprobs.logprob) for e in handle if e.token_id is not None], steps
    (streamed, streamed_steps), (chunked, chunked_steps) = runs[1], runs[5]
    assert chunked_steps < streamed_steps - 20  # 31 tokens past the window: 7 chunks, not 31 steps
    assert [t for t, _ in chunked] == [t for t, _ in streamed] and len(streamed) == 12
    torch.testing.assert_close(torch.tensor([p for _, p in chunked]), torch.tensor([p for _, p in streamed]),
                               atol=1e-5, rtol=0)


def test_a_chunk_past_the_window_is_cut_the_same_under_load():
    """Whole chunks only past the window: with reference attention (each query alone over its
    keys, whatever the cuts before the window) the request's tokens and log-probabilities are
    bit for bit those it gets alone, though other requests take most of each step's budget."""
    model, policy = _model(), SinkPolicy(3, 6, chunk=5)
    prompt = _prompts()[2]
    params = RequestParams(max_new_tokens=10, eos_ids=(), logprobs=0)

    def events(others: int) -> list:
        engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=64, max_batch=5, token_budget=8,
                                                  sink=policy, attention="reference"))
        busy = [engine.submit([7, 8, 9], RequestParams(max_new_tokens=30, eos_ids=())) for _ in range(others)]
        handle = engine.submit(prompt, params)
        engine.run_until_done()
        assert all(h.wait().n_generated == 30 for h in busy)
        return [(e.token_id, e.logprobs.logprob) for e in handle if e.token_id is not None]

    alone = events(0)
    assert len(alone) == 10 and events(4) == alone
