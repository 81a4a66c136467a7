"""The engine's lens read out for every lens request of a step in one call: each request's
numbers equal those it reads as the step's only lens reader (exact floats, float and quantized
heads), its chosen layers equal those rows of the all-layer lens, and the layers are validated;
the capture kept in one copy per site still equals run_with_cache."""

import pytest
import torch

from glassformer.accel.quantize import quantize_model
from glassformer.interpret.lens import logit_lens, residual_sites
from glassformer.interpret.trace import run_with_cache
from glassformer.serving import Engine, EngineConfig, RequestParams, runner


@pytest.mark.parametrize("mode", [None, "int8", "int4"])
def test_a_request_reads_the_same_lens_whoever_else_reads_it(tiny, prompts, request, mode, run_in_turn):
    if mode is not None:
        request.getfixturevalue("kernels")
    model = tiny() if mode is None else quantize_model(tiny(), mode)
    todo = prompts([9, 5, 13])
    plain = RequestParams(max_new_tokens=6, eos_ids=())
    reading = RequestParams(max_new_tokens=6, eos_ids=(), lens=3)
    others = [RequestParams(max_new_tokens=6, eos_ids=(), lens=2),
              RequestParams(max_new_tokens=6, eos_ids=(), lens=4, lens_layers=(2, 0))]
    alone = run_in_turn(model, todo, [plain, reading, plain])[1]
    shared = run_in_turn(model, todo, [others[0], reading, others[1]])
    assert torch.equal(shared[1].lens[0], alone.lens[0]) and torch.equal(shared[1].lens[1], alone.lens[1])
    tokens = alone.prompt_ids + alone.generated_ids[:-1]
    oracle = logit_lens(model, torch.tensor([tokens]), top_k=3)
    torch.testing.assert_close(alone.lens[1], oracle.probs[:, 0], atol=1e-5, rtol=1e-5)
    assert torch.equal(alone.lens[0][:, :, 0], oracle.ids[:, 0, :, 0])  # the top token of each layer
    for other, result in zip(others, shared[::2], strict=True):  # the others read their own k and layers
        assert result.lens[0].shape == (len(other.lens_layers or residual_sites(model.config)),
                                        len(result.prompt_ids) + len(result.generated_ids) - 1, other.lens)


def test_the_lens_is_the_same_however_its_rows_fall_into_calls(tiny, prompts, monkeypatch, run_in_turn):
    model = tiny()
    params = [RequestParams(max_new_tokens=5, eos_ids=(), lens=k) for k in (2, 3, 1)]
    todo = prompts([9, 5, 13])
    whole = run_in_turn(model, todo, params)
    monkeypatch.setattr(runner, "LENS_ROWS", 3)  # calls that split requests and sites
    split = run_in_turn(model, todo, params)
    for a, b in zip(whole, split, strict=True):
        assert torch.equal(a.lens[0], b.lens[0]) and torch.equal(a.lens[1], b.lens[1])


def test_chosen_layers_are_those_rows_of_the_all_layer_lens(tiny, prompts, run_in_turn):
    model = tiny()
    every = RequestParams(max_new_tokens=5, eos_ids=(), lens=3)
    some = RequestParams(max_new_tokens=5, eos_ids=(), lens=3, lens_layers=(2, 0))
    prompt = prompts([7])[0]
    full, chosen = run_in_turn(model, [prompt, prompt], [every, some])
    assert chosen.generated_ids == full.generated_ids
    assert full.lens[0].shape[0] == model.config.n_layers + 1 and chosen.lens[0].shape[0] == 2
    for got, expected in zip(chosen.lens, full.lens, strict=True):
        assert torch.equal(got, expected[[2, 0]])


def test_lens_layers_are_refused_by_name(tiny):
    model = tiny()
    engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=16))
    last = model.config.n_layers
    for layers in [(last + 1,), (1, 1)]:
        with pytest.raises(ValueError, match="^lens_layers: "):
            engine.submit([1, 2, 3], RequestParams(lens=2, lens_layers=layers))
    for fields in [{"lens_layers": (1,)}, {"lens": 2, "lens_layers": ()}, {"lens": 2, "lens_layers": (-1,)},
                   {"lens": 2, "lens_layers": [1]}]:
        with pytest.raises(ValueError, match="^lens_layers: "):
            RequestParams(**fields)
    assert RequestParams.from_fields(lens=2, lens_layers=[0, last]).lens_layers == (0, last)


def test_capture_in_one_copy_per_site_equals_run_with_cache(tiny, prompts, run_in_turn):
    model = tiny()
    sites = ("blocks.0.attn.q", "blocks.1.mlp.hidden", "blocks.1.resid_post")
    plain = RequestParams(max_new_tokens=5, eos_ids=())
    capturing = RequestParams(max_new_tokens=5, eos_ids=(), capture=sites)
    result = run_in_turn(model, prompts([9, 11, 6]), [plain, capturing, plain])[1]
    tokens = result.prompt_ids + result.generated_ids[:-1]
    _, cache = run_with_cache(model, torch.tensor([tokens]), names=sites)
    for site in sites:
        torch.testing.assert_close(result.captured[site], cache[site], atol=1e-5, rtol=1e-5)
