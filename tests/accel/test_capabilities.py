"""Every fast path's capability table classifies every ModelConfig field; what a table refuses
is refused by name, and what it accepts computes what the module path computes."""

import dataclasses
import random

import pytest
import torch

from glassformer import KVCache, ModelConfig, Transformer
from glassformer.accel import fast_decode, fast_training, quantize
from glassformer.accel.capabilities import CapabilityTable, any_value, only
from glassformer.accel.fast_decode import FastDecoder, why_not
from glassformer.accel.quantize import quantize_model
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.serving import executors, graph_path

# Every fast path's table, the serving engine's (its module path's) and its graph executor's among them.
TABLES = [fast_decode.CAPABILITIES, fast_training.CAPABILITIES, quantize.CAPABILITIES,
          executors.CAPABILITIES, graph_path.CAPABILITIES]

# For each field some table limits: a value ModelConfig accepts that lies outside the limit.
OUTSIDE = {"position": "relative", "norm_placement": "post", "qk_norm": "head", "causal": False,
           "n_encoder_layers": 2, "norm_weight_offset": 1.0, "embed_scale": True,
           "attn_softcap": 50.0, "attn_scale": 16.0, "layer_windows": (4, None)}

BASE = ModelConfig(vocab_size=61, context_length=32, d_model=32, n_layers=2, n_heads=4,
                   position="rope", norm="rmsnorm", activation="silu", gated=True)


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_every_field_is_classified_in_every_table(table):
    assert table.unclassified() == [], f"{table.name}: classify these ModelConfig fields"
    assert set(table.rules) <= {f.name for f in dataclasses.fields(ModelConfig)}


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_each_refused_value_is_refused_naming_the_field(table):
    assert table.why_not(BASE) is None
    for name, rule in table.refused().items():
        assert name in OUTSIDE, f"give {name} a value outside {table.name}'s rule"
        value = OUTSIDE[name]
        assert not rule.accepts(value)
        reason = table.why_not(BASE.replace(**{name: value}))
        assert reason == f"{table.name}: {name}={value!r} is not computed ({rule.reason})"
        assert "\n" not in reason


def test_a_field_no_rule_names_is_refused():
    rules = {f.name: any_value() for f in dataclasses.fields(ModelConfig) if f.name != "gated"}
    table = CapabilityTable("some path", rules)
    assert table.unclassified() == ["gated"]
    assert table.why_not(BASE) == "some path: gated is not classified, so not computed"
    limited = CapabilityTable("some path", {**rules, "gated": only(False, reason="no gate")})
    assert limited.why_not(BASE) == "some path: gated=True is not computed (no gate)"


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("changes", [{"position": "relative"}, {"norm_placement": "post"}])
def test_a_refused_config_keeps_the_module_path(changes):
    model = quantize_model(Transformer(BASE.replace(**changes)), "none")
    field = next(iter(changes))
    with torch.no_grad():
        assert why_not(model).startswith(f"fused decode step: {field}=")
        assert model.fused_step() is None
        ids = generate(model, [3, 1, 4], GenerationConfig(max_new_tokens=4, eos_ids=()))
    assert len(ids.generated_ids) == 4


def random_decoder(rng: random.Random) -> ModelConfig:
    """A decoder-only config of the values the fused decode step takes, drawn at random."""
    position = rng.choice(["learned", "sinusoidal", "rope", "rope", "alibi", "none"])
    n_heads = rng.choice([2, 4])
    rope = {}
    if position == "rope" and rng.random() < 0.5:
        rope = {"rope_scaling": rng.choice(["linear", "ntk", "yarn"]), "rope_factor": 2.0}
    return BASE.replace(
        position=position, n_heads=n_heads, n_kv_heads=rng.choice([None, 1, n_heads // 2]),
        d_head=rng.choice([None, 8]), d_ff=rng.choice([None, 48]),
        norm=rng.choice(["layernorm", "rmsnorm"]), norm_bias=rng.random() < 0.5,
        activation=rng.choice(["relu", "gelu", "gelu_tanh", "silu"]), gated=rng.random() < 0.5,
        attn_bias=rng.random() < 0.5, attn_out_bias=rng.random() < 0.5,
        mlp_bias=rng.random() < 0.5, lm_head_bias=rng.random() < 0.5,
        final_norm=rng.random() < 0.7, tie_embeddings=rng.random() < 0.5,
        sliding_window=rng.choice([None, 3, 7]), scale_scores=rng.random() < 0.5,
        scale_head_input=rng.random() < 0.5, head=rng.choice(["lm", "mlm"]),
        n_token_types=rng.choice([0, 2]), embed_norm=rng.random() < 0.3, **rope)


def with_family_pieces(config: ModelConfig, seed: int) -> ModelConfig:
    """For odd seeds, `config` with RoPE turning half of each head and, where it is pre-norm,
    a parallel block (GPT-NeoX's pieces)."""
    if seed % 2 == 0:
        return config
    return config.replace(position="rope", rotary_dim=config.head_dim // 2,
                          parallel_block=config.norm_placement == "pre")


def with_norm_pieces(config: ModelConfig, rng: random.Random) -> ModelConfig:
    """`config` with the norms and scores of Qwen3, OLMo 2 and Gemma drawn: query/key norms,
    output or sandwich norms, (offset + w) norms, the embedding scale, soft-capped scores, a
    score scale and per-layer windows (pre-norm where the block is parallel)."""
    placements = ["pre"] if config.parallel_block else ["pre", "out", "sandwich"]
    windows = rng.choice([None, (3, None), (None, 5)]) if config.sliding_window is None else None
    return config.replace(
        norm_placement=rng.choice(placements), qk_norm=rng.choice(["none", "head", "all"]),
        norm_weight_offset=rng.choice([0.0, 1.0]) if config.norm == "rmsnorm" else 0.0,
        embed_scale=rng.random() < 0.5, attn_softcap=rng.choice([None, 0.5, 20.0]),
        attn_scale=rng.choice([None, 12.0]) if config.scale_scores else None,
        layer_windows=windows)


def randomized(config: ModelConfig, seed: int) -> Transformer:
    """A model whose every parameter (norms and biases too) is random, so each one counts."""
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(centre + 0.3 * torch.randn_like(p))
    return model


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("seed", range(16))
def test_the_fused_step_computes_every_config_it_accepts(seed):
    rng = random.Random(seed)
    config = with_family_pieces(random_decoder(rng), seed)
    if seed >= 6:
        config = with_norm_pieces(config, rng)
    assert fast_decode.CAPABILITIES.why_not(config) is None
    model = quantize_model(randomized(config, seed), "none")
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        step = model.fused_step()
        assert isinstance(step, FastDecoder), why_not(model)
        fused_cache, module_cache = KVCache(config, 1), KVCache(config, 1)
        model(ids[:, :4], cache=fused_cache)
        model(ids[:, :4], cache=module_cache)
        for t in range(4, 16):  # past every window
            fused = step(ids[0, t : t + 1], fused_cache)  # (1, V)
            expected = model(ids[:, t : t + 1], cache=module_cache)[:, -1]
            torch.testing.assert_close(fused, expected, atol=1e-4, rtol=1e-4, msg=str(config))


@pytest.mark.parametrize("seed", range(4))
def test_the_quantized_kernels_compute_every_config_they_accept(seed):
    rng = random.Random(100 + seed)
    config = with_family_pieces(random_decoder(rng).replace(
        norm_placement=rng.choice(["post", "out"]), qk_norm=rng.choice(["none", "head", "all"])), seed)
    assert quantize.CAPABILITIES.why_not(config) is None
    plain = randomized(config, seed).eval()
    converted = randomized(config, seed)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = plain(ids)
        quantize_model(converted, "none")
        torch.testing.assert_close(converted(ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_the_fused_training_passes_compute_every_config_they_accept(seed):
    rng = random.Random(200 + seed)
    config = with_family_pieces(random_decoder(rng).replace(
        dropout=0.0, norm_placement=rng.choice(["pre", "out"]), qk_norm=rng.choice(["none", "head", "all"])),
        seed)
    assert fast_training.CAPABILITIES.why_not(config) is None
    plain, fast = randomized(config, seed), randomized(config, seed)
    fast_training.use_fast_training(fast)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    grads = []
    for model in (fast, plain):
        logits = model(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size),
                                          ids[:, 1:].reshape(-1)).backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-4, atol=1e-5, msg=name)
