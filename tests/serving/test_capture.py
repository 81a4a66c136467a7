"""Sites captured inside the engine's batched step, for the requests that ask, against
glassformer.trace's run_with_cache on the same request alone (the module path)."""

import pytest
import torch

from glassformer.accel.quantize import quantize_model
from glassformer.generation.config import GenerationConfig
from glassformer.interpret.trace import run_with_cache
from glassformer.model.sites import parse_site
from glassformer.serving import Engine, EngineConfig, RequestParams

SITES = ("embed.out", "blocks.0.attn.q", "blocks.1.attn.k", "blocks.0.mlp.hidden", "blocks.1.resid_post")




@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("attention", ["reference", "fast"])
def test_captured_sites_equal_run_with_cache_alone(tiny, prompts, name, attention, run_in_turn):
    model = tiny(name)
    todo = prompts([9, 5, 13])
    plain = RequestParams(max_new_tokens=6, eos_ids=())
    asking = RequestParams(max_new_tokens=6, eos_ids=(), capture=SITES)
    results = run_in_turn(model, todo, [plain, asking, plain], attention)
    result = results[1]
    tokens = result.prompt_ids + result.generated_ids[:-1]
    _, cache = run_with_cache(model, torch.tensor([tokens]), names=SITES)
    assert set(result.captured) == set(SITES)
    for site in SITES:
        torch.testing.assert_close(result.captured[site], cache[site], atol=1e-5, rtol=1e-5)
    assert results[0].captured is None and results[2].captured is None


def test_requests_that_ask_nothing_are_bitwise_unchanged(tiny, prompts, kernels, run_in_turn):
    model = quantize_model(tiny(), "int8")
    todo = prompts([9, 5, 13])
    plain = RequestParams(max_new_tokens=8, eos_ids=(), logprobs=2)
    asking = RequestParams(max_new_tokens=8, eos_ids=(), capture=SITES)
    without = run_in_turn(model, todo, [plain, plain, plain])
    with_capture = run_in_turn(model, todo, [plain, asking, plain])
    for i in (0, 2):
        assert with_capture[i].generated_ids == without[i].generated_ids


def test_capture_is_refused_by_name(tiny):
    engine = Engine(tiny(), None, EngineConfig(n_blocks=16))
    for sites, words in ((("blocks.9.resid_post",), "no site"), (("blocks.0.attn.pattern",), "token axis"),
                         (("logits",), "token axis")):
        with pytest.raises(ValueError, match=f"^capture: .*{words}"):
            engine.submit([1, 2, 3], RequestParams(capture=sites))
    with pytest.raises(ValueError, match="^capture: "):
        RequestParams(capture="blocks.0.resid_post")
    with pytest.raises(TypeError, match="'capture'"):  # generate's sites are glassformer.trace's
        GenerationConfig(capture=("blocks.0.resid_post",))


def test_each_event_carries_the_rows_computed_since_the_previous(tiny, prompts):
    """The prompt's rows with the first token, then one row per token; together, in order, the
    result's capture, bitwise (prefill cut into chunks, other requests beside it)."""
    model = tiny()
    engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=64, token_budget=8, max_batch=4))
    plain = engine.submit(prompts([5])[0], RequestParams(max_new_tokens=6, eos_ids=()))
    asking = engine.submit(prompts([13])[0], RequestParams(max_new_tokens=6, eos_ids=(), capture=SITES))
    engine.run_until_done()
    events = list(asking)
    assert [e.captured[SITES[0]].shape[1] for e in events] == [13, 1, 1, 1, 1, 1]
    result = asking.wait(0)
    for site in SITES:
        streamed = torch.cat([e.captured[site] for e in events], dim=parse_site(site).token_axis)
        assert torch.equal(streamed, result.captured[site])
    assert all(e.captured is None for e in plain)
