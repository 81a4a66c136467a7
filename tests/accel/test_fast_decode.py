import pytest
import torch

from glassformer import KVCache, Transformer, get_preset
from glassformer.accel.fast_decode import fast_decoder, why_not
from glassformer.accel.quantize import quantize_model

PRE_NORM = ["tiny-gpt2", "tiny-llama", "tiny-mqa", "tiny-alibi", "tiny-mistral"]


def _converted(name, mode, **changes):
    config = get_preset(name).replace(**changes)
    model = quantize_model(Transformer(config), mode)
    return model


@pytest.mark.parametrize("name", PRE_NORM)
@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
@pytest.mark.usefixtures("kernels")
def test_fused_step_equals_the_module_path(name, mode):
    model = _converted(name, mode)
    ids = torch.randint(0, 96, (1, 20))
    with torch.no_grad():
        step = fast_decoder(model)
        assert step is not None
        fused_cache, module_cache = KVCache(model.config, 1), KVCache(model.config, 1)
        model(ids[:, :5], cache=fused_cache)
        model(ids[:, :5], cache=module_cache)
        for t in range(5, 20):
            fused = step(ids[0, t : t + 1], fused_cache)  # (1, V)
            expected = model(ids[:, t : t + 1], cache=module_cache)[:, -1]
            torch.testing.assert_close(fused, expected, atol=2e-5, rtol=2e-5)
        assert fused_cache.length == module_cache.length == 20
        torch.testing.assert_close(fused_cache.keys[1][:, :, :20], module_cache.keys[1][:, :, :20])


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_avx2_build_steps_like_the_module_path(avx2_kernels, monkeypatch, mode):
    from glassformer.accel import fast_decode

    monkeypatch.setattr(fast_decode, "extension", lambda: avx2_kernels)
    model = _converted("tiny-mqa", mode)
    ids = torch.randint(0, 96, (1, 8))
    with torch.no_grad():
        step = fast_decoder(model)
        assert step.step_fn.__class__.__module__ == avx2_kernels.__name__
        cache = KVCache(model.config, 1)
        model(ids[:, :7], cache=cache)
        torch.testing.assert_close(step(ids[0, 7:8], cache), model(ids)[:, -1], atol=2e-5, rtol=2e-5)


@pytest.mark.usefixtures("kernels")
def test_gelu_and_relu_feedforward():
    for activation in ("gelu", "relu", "silu"):
        model = _converted("tiny-gpt2", "none", activation=activation, gated=activation == "silu",
                           norm_bias=activation != "gelu")
        ids = torch.randint(0, 96, (1, 6))
        with torch.no_grad():
            cache = KVCache(model.config, 1)
            model(ids[:, :5], cache=cache)
            fused = fast_decoder(model)(ids[0, 5:6], cache)
            torch.testing.assert_close(fused, model(ids)[:, -1], atol=2e-5, rtol=2e-5)


def test_when_it_does_not_apply():
    plain = Transformer(get_preset("tiny-llama"))
    with torch.no_grad():
        assert "decode kernels" in why_not(plain.eval())
        post = quantize_model(Transformer(get_preset("tiny-gpt1")), "none")
        assert "pre-norm" in why_not(post)
        model = _converted("tiny-llama", "none")
        with model.hooks.installed({"blocks.0.attn.q": lambda t, s: None}):
            assert "hooks" in why_not(model)
    assert "no grad" in why_not(model)


@pytest.mark.usefixtures("kernels")
def test_generation_takes_the_fused_step_and_keeps_greedy_tokens(monkeypatch):
    from glassformer.accel import fast_decode
    from glassformer.generation import generate

    model = _converted("tiny-llama", "none")
    config = generate.GenerationConfig(max_new_tokens=12)
    calls = []
    original = fast_decode.FastDecoder.__call__

    def counted(self, token, cache):
        calls.append(cache.length)
        return original(self, token, cache)

    monkeypatch.setattr(fast_decode.FastDecoder, "__call__", counted)
    fused = generate.generate(model, [3, 1, 4, 1, 5], config).generated_ids
    assert len(calls) == 11  # every token after the first comes from the fused step
    monkeypatch.setattr(generate, "fast_decoder", lambda model: None)
    assert generate.generate(model, [3, 1, 4, 1, 5], config).generated_ids == fused
