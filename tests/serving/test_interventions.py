"""Steering, head ablation and the lens for one request inside the engine's batched step,
against the module path run alone with the same change made by hand (interpret.trace hooks,
interpret.lens), and the other requests of the batch against a run without that request."""

import pytest
import torch

from glassformer.accel.quantize import quantize_model
from glassformer.generation.config import GenerationConfig, Steer
from glassformer.interpret.lens import logit_lens
from glassformer.interpret.trace import intervene, run_with_cache
from glassformer.serving import Engine, EngineConfig, RequestParams

SEEN = ("blocks.1.resid_post",)  # captured to compare the numbers, not only the tokens




def _reference(model, result, hooks):
    """The request's tokens through the module path alone with `hooks`: (logits, cache)."""
    tokens = result.prompt_ids + result.generated_ids[:-1]
    with intervene(model, hooks):
        return run_with_cache(model, torch.tensor([tokens]), names=SEEN)


def _check_against(model, result, hooks):
    logits, cache = _reference(model, result, hooks)
    torch.testing.assert_close(result.captured[SEEN[0]], cache[SEEN[0]], atol=1e-5, rtol=1e-5)
    start = len(result.prompt_ids) - 1
    assert logits[0, start:].argmax(-1).tolist() == result.generated_ids


def _vector(model, seed=3):
    return torch.randn(model.config.d_model, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention", ["reference", "fast"])
def test_steered_rows_equal_the_module_path_with_alpha_v_added(tiny, prompts, attention, run_in_turn):
    model = tiny()
    v, alpha = _vector(model), 2.5
    plain = RequestParams(max_new_tokens=6, eos_ids=())
    steering = RequestParams(max_new_tokens=6, eos_ids=(), capture=SEEN,
                             steer=(Steer("blocks.0.resid_post", v, alpha),))
    result = run_in_turn(model, prompts([9, 5, 13]), [plain, steering, plain], attention)[1]

    def add(tensor, site):
        return tensor + alpha * v

    _check_against(model, result, {"blocks.0.resid_post": add})
    unsteered = run_in_turn(model, prompts([9, 5, 13]), [plain, plain, plain], attention)[1]
    assert unsteered.generated_ids != result.generated_ids  # the steer did change the text


def test_ablated_head_equals_zeroing_it_by_hand(tiny, prompts, run_in_turn):
    model = tiny()
    plain = RequestParams(max_new_tokens=6, eos_ids=())
    ablating = RequestParams(max_new_tokens=6, eos_ids=(), capture=SEEN, ablate=("blocks.0.attn.head.1",))
    result = run_in_turn(model, prompts([9, 5, 13]), [plain, ablating, plain])[1]

    def zero(tensor, site):  # (B, H, T, d_head)
        out = tensor.clone()
        out[:, 1] = 0
        return out

    _check_against(model, result, {"blocks.0.attn.context": zero})


def test_lens_per_request_equals_logit_lens_alone(tiny, prompts, run_in_turn):
    model = tiny("tiny-gpt2")
    plain = RequestParams(max_new_tokens=5, eos_ids=())
    reading = RequestParams(max_new_tokens=5, eos_ids=(), lens=3)
    results = run_in_turn(model, prompts([9, 5, 13]), [plain, reading, plain])
    ids, probs = results[1].lens
    tokens = results[1].prompt_ids + results[1].generated_ids[:-1]
    alone = logit_lens(model, torch.tensor([tokens]), top_k=3)
    assert ids.shape == (model.config.n_layers + 1, len(tokens), 3)
    torch.testing.assert_close(probs, alone.probs[:, 0], atol=1e-5, rtol=1e-5)
    assert torch.equal(ids, alone.ids[:, 0])
    assert results[0].lens is None and results[2].lens is None


@pytest.mark.parametrize("converted", [False, True])
def test_other_rows_are_bitwise_unchanged_and_alpha_zero_is_no_steer(tiny, prompts, request, converted):
    if converted:
        request.getfixturevalue("kernels")  # the fused step: the C++ kernels
    model = quantize_model(tiny(), "int8") if converted else tiny()
    todo = prompts([9, 5, 13])
    plain = RequestParams(max_new_tokens=8, eos_ids=(), logprobs=2)
    v = _vector(model)
    steering = RequestParams(max_new_tokens=8, eos_ids=(), logprobs=2,
                             steer=(Steer("blocks.1.resid_mid", v, 4.0),), ablate=("blocks.1.attn.head.0",))
    zero = RequestParams(max_new_tokens=8, eos_ids=(), logprobs=2,
                         steer=(Steer("blocks.1.resid_mid", v, 0.0),))
    runs = (_events(model, todo, [plain, p, plain]) for p in (plain, steering, zero))
    without, with_steer, with_zero = runs
    for i in (0, 2):
        assert with_steer[i] == without[i]
    assert with_zero == without
    assert with_steer[1] != without[1]


def _events(model, prompts, params):
    """Each request's tokens and log-probabilities (exact floats), stepping as run_in_turn does."""
    engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=64, token_budget=8, max_batch=4))
    handles = []
    for prompt, p in zip(prompts, params, strict=True):
        handles.append(engine.submit(prompt, p))
        engine.step()
    engine.run_until_done()
    return [[(e.token_id, e.logprobs) for e in h] for h in handles]


def test_steered_blocks_stay_out_of_the_prefix_cache(tiny, prompts):
    model = tiny()
    prompt = prompts([12])[0]
    plain = RequestParams(max_new_tokens=4, eos_ids=(), logprobs=1)
    steering = RequestParams(max_new_tokens=4, eos_ids=(),
                             steer=(Steer("blocks.0.resid_pre", _vector(model), 3.0),))
    engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=64))
    engine.submit(prompt, steering)
    engine.run_until_done()
    after = engine.submit(prompt, plain)
    engine.run_until_done()
    assert [(e.token_id, e.logprobs) for e in after] == _events(model, [prompt], [plain])[0]


def test_steering_and_ablation_are_refused_by_name(tiny):
    engine = Engine(tiny(), None, EngineConfig(n_blocks=16))
    d = engine.model.config.d_model
    cases = [
        (dict(steer=(Steer("blocks.9.resid_post", torch.ones(d), 1.0),)), "^steer: .*no site"),
        (dict(steer=(Steer("blocks.0.attn.q", torch.ones(d), 1.0),)), "^steer: .*d_model"),
        (dict(steer=(Steer("blocks.0.resid_post", torch.ones(d + 1), 1.0),)), "^steer: .*width"),
        (dict(ablate=("blocks.0.attn.head.99",)), "^ablate: .*no head"),
        (dict(ablate=("blocks.7.attn.head.0",)), "^ablate: .*no block"),
        (dict(ablate=("blocks.0.attn.2",)), "^ablate: .*head name"),
    ]
    for fields, words in cases:
        with pytest.raises(ValueError, match=words):
            engine.submit([1, 2, 3], RequestParams(**fields))
    for alpha in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="^steer: alpha"):
            Steer("blocks.0.resid_post", torch.ones(d), alpha)
    with pytest.raises(ValueError, match="^lens: "):
        RequestParams(lens=0)
    with pytest.raises(TypeError, match="'steer'"):  # generate steers with interpret.steer.steered
        GenerationConfig(steer=(Steer("blocks.0.resid_post", torch.ones(d), 1.0),))


def test_a_lens_request_recomputed_after_preemption_has_each_position_once(tiny, prompts):
    model = tiny("tiny-gpt2")
    engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=10, token_budget=8, max_batch=4))
    params = [RequestParams(max_new_tokens=6, eos_ids=(), lens=2) for _ in range(3)]
    handles = [engine.submit(p, q) for p, q in zip(prompts([9, 5, 13]), params, strict=True)]
    engine.run_until_done()
    assert engine.scheduler.preemptions > 0
    for handle in handles:
        result = handle.wait(0)
        tokens = result.prompt_ids + result.generated_ids[:-1]
        alone = logit_lens(model, torch.tensor([tokens]), top_k=2)
        torch.testing.assert_close(result.lens[1], alone.probs[:, 0], atol=1e-5, rtol=1e-5)
