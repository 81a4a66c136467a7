import pytest
import torch

from glassformer import PRESETS, KVCache, Transformer, get_preset
from glassformer.interpret.trace import ablate, capture, patch, run_with_cache
from glassformer.model.layers import attention
from glassformer.model.layers.attention_backends import repeat_kv
from glassformer.model.sites import parse_site

TINY = sorted(name for name in PRESETS if name.startswith("tiny-") and not PRESETS[name].n_encoder_layers)
T = 6


def make(name: str) -> Transformer:
    torch.manual_seed(0)
    return Transformer(get_preset(name)).eval()


def ids_for(model: Transformer, T: int = T, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, T), generator=g)


def expected_sizes(model: Transformer, T: int, S: int) -> dict[str, int]:
    c = model.config
    return {
        "batch": 1, "pos": T, "query": T, "key": S, "d_model": c.d_model, "head": c.n_heads,
        "kv_head": c.kv_heads, "d_head": c.head_dim, "d_ff": c.ff_dim, "vocab": c.vocab_size,
    }


@pytest.mark.parametrize("name", TINY)
def test_every_site_has_its_documented_shape(name):
    model = make(name)
    logits, cache = run_with_cache(model, ids_for(model))
    assert list(cache) == list(model.hooks.sites)  # every site, in forward order
    sizes = expected_sizes(model, T, T)
    for site, tensor in cache.items():
        assert tuple(tensor.shape) == tuple(sizes[d] for d in parse_site(site).dims), site
    torch.testing.assert_close(cache["logits"], logits)


def test_gqa_shapes_keep_fewer_key_value_heads():
    model = make("tiny-llama")  # 4 query heads share 2 key/value heads
    _, cache = run_with_cache(model, ids_for(model), names=lambda n: n.startswith("blocks.1.attn"))
    assert cache["blocks.1.attn.q"].shape == (1, 4, T, 8)
    assert cache["blocks.1.attn.k"].shape == (1, 2, T, 8)
    assert cache["blocks.1.attn.v"].shape == (1, 2, T, 8)
    assert cache["blocks.1.attn.pattern"].shape == (1, 4, T, T)


@pytest.mark.parametrize("name", TINY)
def test_pattern_rows_are_distributions_respecting_the_mask(name):
    model = make(name)
    _, cache = run_with_cache(model, ids_for(model), names=lambda n: n.endswith("pattern"))
    window = model.config.sliding_window
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    hidden = torch.zeros(T, T, dtype=torch.bool)
    if model.config.causal:
        hidden |= k > q
    if window is not None:
        hidden |= q - k >= window
    for pattern in cache.values():
        torch.testing.assert_close(pattern.sum(-1), torch.ones(pattern.shape[:-1]))
        assert (pattern[..., hidden] == 0).all()
        assert (pattern[..., ~hidden] > 0).all()


def test_captured_tensors_agree_with_the_plain_math():
    model = make("tiny-gpt2")
    _, c = run_with_cache(model, ids_for(model))
    torch.testing.assert_close(c["embed.out"], c["embed.tokens"] + c["embed.positions"])
    scores = c["blocks.0.attn.q"] @ c["blocks.0.attn.k"].transpose(-2, -1) / 8**0.5
    torch.testing.assert_close(c["blocks.0.attn.scores"], scores)
    torch.testing.assert_close(c["blocks.0.attn.pattern"], c["blocks.0.attn.masked_scores"].softmax(-1))
    torch.testing.assert_close(c["blocks.0.attn.context"], c["blocks.0.attn.pattern"] @ c["blocks.0.attn.v"])
    torch.testing.assert_close(c["blocks.0.resid_mid"], c["blocks.0.resid_pre"] + c["blocks.0.attn.out"])
    torch.testing.assert_close(c["blocks.0.resid_post"], c["blocks.0.resid_mid"] + c["blocks.0.mlp.out"])
    torch.testing.assert_close(c["blocks.1.resid_pre"], c["blocks.0.resid_post"])


def test_capturing_does_not_change_the_output():
    model = make("tiny-llama")
    ids = ids_for(model)
    with torch.no_grad():
        plain = model(ids)
    logits, _ = run_with_cache(model, ids)
    torch.testing.assert_close(logits, plain)


def test_only_weight_sites_switch_to_the_reference_kernel(monkeypatch):
    model = make("tiny-llama")
    calls = []
    original = attention.reference_attention
    monkeypatch.setattr(
        attention, "reference_attention", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    run_with_cache(model, ids_for(model), names=["blocks.0.attn.q", "blocks.1.attn.context"])
    assert calls == []
    run_with_cache(model, ids_for(model), names=["blocks.1.attn.pattern"])
    assert calls == [1]  # layer 1 only


def test_decode_step_shows_one_query_row_against_the_cached_keys():
    model = make("tiny-llama")
    ids = ids_for(model, T + 1)
    _, full = run_with_cache(model, ids)
    cache = KVCache(model.config, batch_size=1)
    run_with_cache(model, ids[:, :T], cache=cache)
    logits, step = run_with_cache(model, ids[:, T:], cache=cache)
    torch.testing.assert_close(logits[:, -1], full["logits"][:, -1], rtol=1e-4, atol=1e-4)
    for layer in range(model.config.n_layers):
        site = f"blocks.{layer}.attn"
        assert step[f"{site}.q"].shape == (1, 4, 1, 8)
        assert step[f"{site}.k"].shape == (1, 2, 1, 8)  # only the new row; the rest is cached
        assert step[f"{site}.pattern"].shape == (1, 4, 1, T + 1)
        torch.testing.assert_close(
            step[f"{site}.pattern"], full[f"{site}.pattern"][:, :, -1:], rtol=1e-4, atol=1e-5
        )
        full_v = repeat_kv(full[f"{site}.v"], 2)
        torch.testing.assert_close(
            step[f"{site}.context"], step[f"{site}.pattern"] @ full_v, rtol=1e-4, atol=1e-5
        )


def test_ablation_changes_the_output_and_is_removed_afterwards():
    model = make("tiny-gpt2")
    ids = ids_for(model)
    with torch.no_grad():
        before = model(ids)
        with ablate(model, "blocks.0.attn.context", heads=[1]):
            ablated = model(ids)
        after = model(ids)
    assert not torch.allclose(ablated, before)
    torch.testing.assert_close(after, before)
    assert not model.hooks


def test_head_ablation_zeroes_only_that_heads_contribution():
    model = make("tiny-gpt2")
    ids = ids_for(model)
    _, clean = run_with_cache(model, ids, names=["blocks.0.attn.context"])
    with ablate(model, "blocks.0.attn.context", heads=[2]):
        _, c = run_with_cache(model, ids, names=["blocks.0.attn.context", "blocks.0.attn.out"])
    context = clean["blocks.0.attn.context"].clone()
    context[:, 2] = 0
    torch.testing.assert_close(c["blocks.0.attn.context"], context)
    attn = model.blocks[0].attn
    expected = attn.out(context.transpose(1, 2).reshape(1, T, -1))
    torch.testing.assert_close(c["blocks.0.attn.out"], expected)


def test_hooks_are_removed_even_when_the_block_raises():
    model = make("tiny-gpt2")
    with pytest.raises(RuntimeError), ablate(model, ["blocks.0.mlp.out", "logits"]):
        raise RuntimeError("boom")
    assert not model.hooks


def test_patching_the_last_residual_reproduces_the_other_run():
    model = make("tiny-llama")
    a, b = ids_for(model, seed=1), ids_for(model, seed=2)
    last = f"blocks.{model.config.n_layers - 1}.resid_post"
    logits_b, cache_b = run_with_cache(model, b, names=[last])
    with torch.no_grad(), patch(model, {last: cache_b[last]}):
        patched = model(a)
    torch.testing.assert_close(patched, logits_b)
    assert not model.hooks


def test_unknown_sites_and_bad_patches_are_rejected():
    model = make("tiny-llama")
    with pytest.raises(ValueError, match="embed.positions"):  # RoPE: no position table
        run_with_cache(model, ids_for(model), names=["embed.positions"])
    with pytest.raises(ValueError, match="head dimension"), ablate(model, "blocks.0.mlp.out", heads=[0]):
        pass
    with pytest.raises(ValueError, match="shape"), patch(model, {"blocks.0.norm1": torch.zeros(1, 2, 32)}):
        model(ids_for(model))
    assert not model.hooks
    with pytest.raises(ValueError, match="unknown hook site"):
        parse_site("blocks.0.attn.weights")


def test_capture_records_every_forward_inside_the_block():
    model = make("tiny-gpt2")
    with torch.no_grad(), capture(model, ["logits"]) as store:
        model(ids_for(model, 3))
        first = store["logits"]
        model(ids_for(model, 4))
    assert first.shape == (1, 3, 96) and store["logits"].shape == (1, 4, 96)
