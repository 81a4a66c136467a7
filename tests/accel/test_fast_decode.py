import gc
import weakref

import pytest
import torch

from glassformer import KVCache, Transformer, get_preset
from glassformer.accel.fast_decode import FastDecoder, fused_adapter, why_not
from glassformer.accel.quantize import quantize_model
from glassformer.generation.generate import GenerationConfig, generate

pytestmark = pytest.mark.usefixtures("kernels")

PRE_NORM = ["tiny-gpt2", "tiny-llama", "tiny-mqa", "tiny-alibi", "tiny-mistral"]
PROMPT, GREEDY = [3, 1, 4, 1, 5], GenerationConfig(max_new_tokens=12, eos_ids=())


def _converted(name, mode, **changes):
    config = get_preset(name).replace(**changes)
    model = quantize_model(Transformer(config), mode)
    return model


# Head sizes and context lengths the attention's vector paths split differently: 8 keys and
# 8 floats a vector, 32 floats and 64 values a pass, and sizes that are no multiple of 8.
LONG = {f"d_head {d}": {"d_model": 4 * d, "context_length": 160} for d in (12, 40, 64)}
# The families' pieces: Qwen3's query/key norms per head, OLMo 2's over all heads with output
# norms, Gemma 2's sandwich and 1 + w norms, scaled embedding, soft-capped and rescaled scores
# and a window on the first layer only; Gemma 3's sliding layer turning by its own RoPE base,
# the global one by a scaled one.
FAMILIES = {
    "qwen3": {"qk_norm": "head"},
    "olmo2": {"qk_norm": "all", "norm_placement": "out"},
    "gemma2": {"norm_placement": "sandwich", "norm_weight_offset": 1.0, "embed_scale": True,
               "attn_softcap": 2.0, "final_softcap": 3.0, "attn_scale": 12.0,
               "layer_windows": (4, None)},
    "gemma3": {"qk_norm": "head", "norm_placement": "sandwich", "norm_weight_offset": 1.0,
               "layer_windows": (4, None), "rope_local_theta": 10.0, "rope_scaling": "linear",
               "rope_factor": 4.0},
}


# The long ones in float only: over 150 steps a one-ulp difference upstream of an int8 / int4
# layer's activation rounding moves the logits by thousandths (the paths' own tolerance in
# tests/test_paths_property.py), more than this test's float tolerance.
@pytest.mark.parametrize("name,changes,length,mode",
                         [(name, {}, 20, mode) for name in PRE_NORM for mode in ("none", "int8", "int4")]
                         + [("tiny-llama", changes, 150, "none") for changes in LONG.values()]
                         + [("tiny-alibi", LONG["d_head 64"], 150, "none")]
                         + [("tiny-llama", changes, 20, mode) for changes in FAMILIES.values()
                            for mode in ("none", "int8", "int4")]
                         # ALiBi after the soft-cap; LayerNorm sandwich norms (no 1 + w there);
                         # a local base without a sliding layer (its angles passed, not read)
                         + [("tiny-alibi", FAMILIES["gemma2"] | {"norm_weight_offset": 0.0}, 20, "none"),
                            ("tiny-llama", {"rope_local_theta": 10.0}, 20, "none"),
                            ("tiny-llama", LONG["d_head 12"] | FAMILIES["gemma2"], 150, "none")])
def test_fused_step_equals_the_module_path(name, changes, length, mode):
    model = _converted(name, mode, **changes)
    ids = torch.randint(0, 96, (1, length))
    with torch.no_grad():
        step = model.fused_step()
        assert isinstance(step, FastDecoder) and model.fused_step() is step  # built once
        fused_cache, module_cache = KVCache(model.config, 1), KVCache(model.config, 1)
        model(ids[:, :5], cache=fused_cache)
        model(ids[:, :5], cache=module_cache)
        for t in range(5, length):
            fused = step(ids[0, t : t + 1], fused_cache)  # (1, V)
            expected = model(ids[:, t : t + 1], cache=module_cache)[:, -1]
            torch.testing.assert_close(fused, expected, atol=2e-5, rtol=2e-5)
        assert fused_cache.length == module_cache.length == length
        torch.testing.assert_close(fused_cache.keys[1][:, :, :length], module_cache.keys[1][:, :, :length])


THREE_GROUPS = {"d_model": 72, "n_heads": 9, "n_kv_heads": 3, "context_length": 160}  # SmolLM2's grouping
SHORT_ROWS, LONG_ROWS = [1, 7, 20, 30, 4, 12, 26], [1, 7, 150, 30, 4, 70, 26]  # sequence lengths


@pytest.mark.parametrize("name,changes,lengths", [(name, {}, SHORT_ROWS) for name in PRE_NORM]
                         + [("tiny-mqa", changes, LONG_ROWS) for changes in LONG.values()]
                         + [("tiny-llama", changes, SHORT_ROWS) for changes in FAMILIES.values()]
                         + [("tiny-mqa", LONG["d_head 12"] | FAMILIES["gemma2"], LONG_ROWS)]
                         # SmolLM2's three key groups of three heads: one row's do not share
                         # out evenly among two threads (a run of heads each); seven rows' are
                         # many (a group a task)
                         + [("tiny-llama", THREE_GROUPS, LONG_ROWS)])
@pytest.mark.parametrize("mode", ["none", "int4"])
def test_rows_over_a_paged_pool_equal_each_sequence_stepped_alone(name, changes, lengths, mode):
    """Seven sequences of different lengths, their keys scattered over a pool: each row's
    logits and new keys are bit for bit those of the one-sequence step (the oracle above),
    which, where the key groups do not share out evenly among the threads (tiny-mqa's one, or
    three on two), gives each thread a run of heads, not a key group a task."""
    model = _converted(name, mode, **changes)
    config = model.config
    g = torch.Generator().manual_seed(0)
    n_slots = sum(lengths) + 2 * len(lengths)
    order = torch.randperm(n_slots, generator=g)  # every sequence's slots, scattered
    with torch.no_grad():
        step = model.fused_step()
        keys = [torch.zeros(n_slots, config.kv_heads, config.head_dim) for _ in model.blocks]
        values = [torch.zeros_like(k) for k in keys]
        slots = torch.zeros(len(lengths), max(lengths) + 1, dtype=torch.long)  # (B, S)
        ids, expected, caches, start = [], [], [], 0
        for b, n in enumerate(lengths):
            prompt = torch.randint(0, 96, (1, n + 1), generator=g)
            cache = KVCache(config, 1)
            model(prompt[:, :n], cache=cache)
            slots[b, : n + 1] = order[start : start + n + 1]
            start += n + 1
            for layer in range(config.n_layers):  # (1, KV, S, d_head) -> the pool's (slot, KV, d_head)
                keys[layer][slots[b, :n]] = cache.keys[layer][0, :, :n].transpose(0, 1)
                values[layer][slots[b, :n]] = cache.values[layer][0, :, :n].transpose(0, 1)
            ids.append(int(prompt[0, n]))
            expected.append(step(prompt[0, n : n + 1], cache))  # (1, V)
            caches.append(cache)
        positions, ids = torch.tensor(lengths), torch.tensor(ids)  # (B,) each
        x = model.embed(ids[None], positions[None])[0]  # (B, d)
        angles = None  # per kind of layer, (B, rotated) each
        if config.position == "rope":
            angles = tuple((cos[0, 0], sin[0, 0]) for cos, sin in model.rope_angles(positions[None]))
        h = step.rows(x, positions, slots, angles, keys, values)  # (B, d)
        for b, n in enumerate(lengths):
            row = h[b : b + 1]
            logits = step.head(row)  # (1, V)
            assert torch.equal(logits, expected[b])
            new = slots[b, n]
            assert torch.equal(keys[-1][new], caches[b].keys[-1][0, :, n])
            assert torch.equal(values[0][new], caches[b].values[0][0, :, n])


def test_rows_refuse_a_slot_outside_the_pool():
    model = _converted("tiny-llama", "int8")
    config = model.config
    with torch.no_grad():
        step = model.fused_step()
        keys = [torch.zeros(4, config.kv_heads, config.head_dim) for _ in model.blocks]
        x = torch.zeros(1, config.d_model)
        angles = torch.zeros(1, config.head_dim)
        with pytest.raises(RuntimeError, match="outside the pool"):
            step.rows(x, torch.tensor([1]), torch.tensor([[0, 9]]), ((angles, angles),), keys, keys)


def test_rows_add_each_row_s_adapter_alone_and_refuse_what_they_cannot_add():
    """(The engine's tests hold the adapter rows against the module path.) Here: a row's update
    leaves the other rows bitwise as they were and does not depend on them; an update of zero
    changes nothing; an adapter on a product the step lacks, or not float32, is not built; bad
    shapes and indices raise."""
    model = _converted("tiny-llama", "int8")
    config = model.config
    g = torch.Generator().manual_seed(0)
    d, inner, rank = config.d_model, config.n_heads * config.head_dim, 2

    def adapter(a_scale: float):  # updates of every layer's out and down products
        widths = {"attn.out": inner, "mlp.down": config.ff_dim}
        return fused_adapter(config.n_layers, {
            (i, path): (torch.randn(rank, width, generator=g) * a_scale,
                        [(0, torch.randn(d, rank, generator=g))])
            for i in range(config.n_layers) for path, width in widths.items()})

    with torch.no_grad():
        step = model.fused_step()
        keys = [torch.zeros(8, config.kv_heads, config.head_dim) for _ in model.blocks]
        values = [torch.zeros_like(k) for k in keys]
        x = torch.randn(3, d, generator=g)  # (B, d)
        positions, slots = torch.zeros(3, dtype=torch.long), torch.arange(3)[:, None]  # (B,), (B, 1)
        cos, sin = torch.ones(3, config.head_dim), torch.zeros(3, config.head_dim)

        def rows(index, adapters, b=slice(None)):
            return step.rows(x[b], positions[b], slots[b], ((cos[b], sin[b]),), keys, values,
                             None if index is None else torch.tensor(index), adapters)

        base, some, none = rows(None, []), adapter(1.0), adapter(0.0)
        mixed = rows([-1, 0, 1], [some, none])
        assert torch.equal(mixed[0], base[0]) and torch.equal(mixed[2], base[2])
        assert not torch.allclose(mixed[1], base[1], atol=1e-3)
        assert torch.equal(rows([0], [some], slice(1, 2))[0], mixed[1])
        a, b = torch.zeros(rank, inner), torch.zeros(d, rank)
        assert fused_adapter(config.n_layers, {(0, "attn.q"): (a, [(0, b)])}) is None
        assert fused_adapter(config.n_layers, {(0, "attn.out"): (a.double(), [(0, b.double())])}) is None
        wrong = fused_adapter(config.n_layers, {(0, "attn.out"): (torch.zeros(rank, inner + 1), [(0, b)])})
        with pytest.raises(RuntimeError, match="LoRA down"):
            rows([0, -1, -1], [wrong])
        with pytest.raises(RuntimeError, match="names adapter 1 of 1"):
            rows([0, 1, -1], [some])


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_avx2_build_steps_like_the_module_path(avx2_kernels, monkeypatch, mode):
    from glassformer.accel import kernels as accel_kernels

    monkeypatch.setattr(accel_kernels, "extension", lambda: avx2_kernels)
    model = _converted("tiny-mqa", mode)
    ids = torch.randint(0, 96, (1, 8))
    with torch.no_grad():
        step = model.fused_step()
        assert step.step_fn.__class__.__module__ == avx2_kernels.__name__
        cache = KVCache(model.config, 1)
        model(ids[:, :7], cache=cache)
        torch.testing.assert_close(step(ids[0, 7:8], cache), model(ids)[:, -1], atol=2e-5, rtol=2e-5)


def test_gelu_and_relu_feedforward():
    for activation in ("gelu", "relu", "silu"):
        model = _converted("tiny-gpt2", "none", activation=activation, gated=activation == "silu",
                           norm_bias=activation != "gelu")
        ids = torch.randint(0, 96, (1, 6))
        with torch.no_grad():
            cache = KVCache(model.config, 1)
            model(ids[:, :5], cache=cache)
            fused = model.fused_step()(ids[0, 5:6], cache)
            torch.testing.assert_close(fused, model(ids)[:, -1], atol=2e-5, rtol=2e-5)


def test_when_it_does_not_apply():
    plain = Transformer(get_preset("tiny-llama")).eval()
    with torch.no_grad():
        assert "decode kernels" in why_not(plain) and plain.fused_step() is None
        post = quantize_model(Transformer(get_preset("tiny-gpt1")), "none")
        assert "norm_placement='post'" in why_not(post) and post.fused_step() is None
        model = _converted("tiny-llama", "none")
        with model.hooks.installed({"blocks.0.attn.q": lambda t, s: None}):
            assert "hooks" in why_not(model) and model.fused_step() is None
        assert why_not(model) is None and model.fused_step() is not None
        model.to(torch.float64)  # checked again after the tensors change
        assert "float32" in why_not(model) and model.fused_step() is None
    assert "no grad" in why_not(model) and model.fused_step() is None


def test_generation_takes_the_fused_step_and_keeps_greedy_tokens(monkeypatch):
    model = _converted("tiny-llama", "none")
    calls = []
    original = FastDecoder.__call__

    def counted(self, token, cache):
        calls.append(cache.length)
        return original(self, token, cache)

    monkeypatch.setattr(FastDecoder, "__call__", counted)
    fused = generate(model, PROMPT, GREEDY).generated_ids
    assert len(calls) == 11  # every token after the first comes from the fused step
    monkeypatch.setattr(model, "fused_step", lambda: None)
    assert generate(model, PROMPT, GREEDY).generated_ids == fused


def _pair(seed):
    """A model converted for decoding and the plain model it came from."""
    torch.manual_seed(seed)
    plain = Transformer(get_preset("tiny-llama")).eval()
    with torch.no_grad():  # weights large enough that greedy tokens tell models apart
        for p in plain.parameters():
            p.normal_()
    converted = Transformer(plain.config)
    converted.load_state_dict(plain.state_dict())
    return quantize_model(converted, "none"), plain


def _fresh_tokens(plain):
    """Greedy tokens of a freshly converted copy of `plain`."""
    fresh = Transformer(plain.config)
    fresh.load_state_dict(plain.state_dict())
    return generate(quantize_model(fresh, "none"), PROMPT, GREEDY).generated_ids


def test_load_state_dict_rebuilds_the_step():
    model, plain = _pair(0)
    _, other = _pair(1)
    own = generate(model, PROMPT, GREEDY).generated_ids  # the step is built on these weights
    assert own != _fresh_tokens(other)
    for assign in (False, True):
        with torch.no_grad():
            before = model.fused_step()
        fresh = Transformer(other.config)
        fresh.load_state_dict(other.state_dict())
        model.load_state_dict(quantize_model(fresh, "none").state_dict(), assign=assign)
        with torch.no_grad():
            assert model.fused_step() is not before
        assert generate(model, PROMPT, GREEDY).generated_ids == _fresh_tokens(other)


def test_to_rebuilds_the_step():
    model, plain = _pair(2)
    _, other = _pair(5)
    assert generate(model, PROMPT, GREEDY).generated_ids != _fresh_tokens(other)
    model.to(torch.float64).to(torch.float32)  # new tensors: a step kept would read the old
    with torch.no_grad():  # the other model's weights into the new tensors, in place
        for name, tensor in model.state_dict().items():  # fp32 kernels: the same names
            tensor.copy_(other.state_dict()[name])
    assert generate(model, PROMPT, GREEDY).generated_ids == _fresh_tokens(other)


def test_quantize_model_rebuilds_the_step():
    _, plain = _pair(3)
    model = Transformer(plain.config)
    model.load_state_dict(plain.state_dict())
    model.install_fused_step(FastDecoder.build)  # before any kernels: the step cannot apply
    with torch.no_grad():
        assert model.fused_step() is None
    quantize_model(model, "none")
    with torch.no_grad():
        assert model.fused_step() is not None
    assert generate(model, PROMPT, GREEDY).generated_ids == _fresh_tokens(plain)


def test_a_model_with_a_built_step_is_freed():
    model, _ = _pair(4)
    generate(model, PROMPT, GREEDY)
    with torch.no_grad():
        assert model.fused_step() is not None
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
