"""The sink policy (model/sink.py) against the model run from scratch on the kept tokens."""

import pytest
import torch

from glassformer import ModelConfig, Transformer
from glassformer.accel.quantize import quantize_model
from glassformer.generation.config import GenerationConfig
from glassformer.generation.generate import generate
from glassformer.model.kv_cache import KVCache
from glassformer.model.sink import SinkKVCache, SinkPolicy


def _model(position="rope", n_layers=1, seed=0, **extra):
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=61, context_length=64, d_model=32, n_layers=n_layers, n_heads=4,
                         n_kv_heads=2, position=position, norm="rmsnorm", activation="silu",
                         gated=True, **extra)
    return Transformer(config).eval()


def test_kept_and_slots_follow_the_equations():
    policy = SinkPolicy(2, 3)
    assert policy.kept(4) == [0, 1, 2, 3]
    assert policy.kept(9) == [0, 1, 6, 7, 8]
    assert policy.kept(1) == [0]
    # the newest token's slot is last, and overwrites the slot of the one that left
    assert policy.kept_slots(6) == [0, 1, 3, 4, 2]
    assert policy.slot(5) == policy.slot(2) and 2 not in policy.kept(6)
    assert [policy.room(n) for n in (0, 3, 5, 9)] == [5, 2, 3, 3]  # then chunks of at most W
    assert [SinkPolicy(2, 3, chunk=1).room(n) for n in (0, 3, 5, 9)] == [5, 2, 1, 1]  # streaming
    assert policy.chunk_slots(9) == [0, 1, 4, 2]  # sinks, then tokens 7 and 8 (6 leaves first)
    window_only = SinkPolicy(0, 3)
    assert window_only.kept(7) == [4, 5, 6]


@pytest.mark.parametrize("position", ["rope", "alibi", "none"])
@pytest.mark.parametrize("sinks", [0, 4])
def test_dense_sink_cache_equals_the_kept_tokens_from_scratch(position, sinks):
    """One layer: the cached keys depend on their token alone, so every step past eviction
    must equal the model uncached on [first S + last W] at positions 0..S+W-1."""
    model, policy = _model(position), SinkPolicy(sinks, 6)
    ids = torch.randint(0, 61, (2, 40))
    cache = SinkKVCache(model.config, 2, policy)
    with torch.no_grad():
        logits = model(ids[:, :5], cache)[:, -1]  # a prompt first: one call, before eviction
        checked = 0
        for t in range(5, 40):
            if t > policy.capacity + 2:
                reference = model(ids[:, policy.kept(t)])[:, -1]  # (2, V)
                torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
                checked += 1
            logits = model(ids[:, t : t + 1], cache)[:, -1]
    assert checked > 20 and cache.seen == 40 and cache.length == policy.capacity - 1


def test_deep_model_equals_dense_before_the_first_eviction():
    model, policy = _model(n_layers=3), SinkPolicy(4, 16)
    ids = torch.randint(0, 61, (1, 20))
    sink, dense = SinkKVCache(model.config, 1, policy), KVCache(model.config, 1)
    with torch.no_grad():
        got, want = ([model(ids[:, :5], cache)[:, -1]]
                     + [model(ids[:, t : t + 1], cache)[:, -1] for t in range(5, 20)]
                     for cache in (sink, dense))
        torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", ["none", "bf16", "int8", "int4"])
def test_every_weight_format_keeps_the_policy(fmt):
    """The policy is the cache's: a converted model (its fused step refused) still equals
    itself run uncached on the kept tokens."""
    model = quantize_model(_model(), fmt)
    policy = SinkPolicy(2, 5)
    ids = torch.randint(0, 61, (1, 24))
    cache = SinkKVCache(model.config, 1, policy)
    with torch.inference_mode():
        assert model.fused_step() is not None or fmt == "bf16"
        with pytest.raises(ValueError, match="sink policy"):
            (model.fused_step() or _refusing)(ids[0, :1], cache)
        for t in range(24):
            logits = model(ids[:, t : t + 1], cache)[:, -1]
        reference = model(ids[:, policy.kept(24)])[:, -1]
    tolerance = 2e-2 if fmt == "bf16" else 1e-4
    torch.testing.assert_close(logits.float(), reference.float(), atol=tolerance, rtol=0)


def _refusing(token, cache):
    raise ValueError("no fused step: the sink policy runs the module path anyway")


def test_decoding_never_recomputes_the_prefix():
    model, policy = _model(n_layers=2), SinkPolicy(4, 8)
    fed = []
    handle = model.embed.register_forward_hook(lambda module, args, out: fed.append(args[0].shape[1]))
    try:
        config = GenerationConfig(max_new_tokens=25, eos_ids=(), sink=policy)
        result = generate(model, list(range(30)), config)
    finally:
        handle.remove()
    # the prompt: 12 tokens in one call, the rest in chunks of at most the window (sink_chunk.py);
    # then one call per new token
    assert fed[:4] == [policy.capacity, 8, 8, 2] and sum(fed) == 30 + result.n_generated - 1
    assert set(fed[4:]) == {1}


@pytest.mark.parametrize("kwargs, field", [
    ({"sink_tokens": -1, "window": 4}, "sink_tokens"),
    ({"sink_tokens": 4, "window": 0}, "window"),
    ({"sink_tokens": 4, "window": 1.5}, "window"),
])
def test_bad_values_are_one_line(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: ") as error:
        SinkPolicy(**kwargs)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("position, extra, field", [
    ("rope", {}, "window"),  # 60 + 8 > context_length 64
    ("learned", {}, "position"),
    ("rope", {"sliding_window": 16}, "window"),
])
def test_models_the_policy_cannot_serve_are_refused(position, extra, field):
    policy = SinkPolicy(8, 60) if not extra and position == "rope" else SinkPolicy(4, 16)
    with pytest.raises(ValueError, match=f"^{field}: "):
        SinkKVCache(_model(position, **extra).config, 1, policy)


def test_generation_config_refuses_what_the_policy_cannot_do():
    with pytest.raises(ValueError, match="^sink: "):
        GenerationConfig(sink=SinkPolicy(), beams=2)
    with pytest.raises(ValueError, match="^sink: "):
        GenerationConfig(sink=SinkPolicy(), use_cache=False)
    with pytest.raises(ValueError, match="^sink: "):
        GenerationConfig(sink=(4, 16))
