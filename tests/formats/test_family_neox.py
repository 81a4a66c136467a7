"""GPT-NeoX / Pythia and Phi-3 Hugging Face folders: tiny random models built with
transformers' own config classes (the oracle), loaded by Glassformer: equal logits, equal
greedy tokens on every path (module, quantized model, serving engine), exported back to
transformers with the same logits; what Glassformer does not compute is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from fused_paths import check_fused_step

from glassformer.accel import fast_decode, kernels
from glassformer.accel.quantize import quantize_model
from glassformer.errors import InputError
from glassformer.formats.export import export_hf
from glassformer.formats.huggingface import config_from_hf, load_hf
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.serving import Engine, EngineConfig, RequestParams

transformers = pytest.importorskip("transformers")
VOCAB = 300
COMMON = dict(vocab_size=VOCAB, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, max_position_embeddings=64, num_hidden_layers=2)
NEOX = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, **COMMON)
PHI3 = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            **COMMON)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.25, 1.5, 2.0], "long_factor": [1.0, 3.0, 6.0, 12.0]}
CONFIGS = {
    # parallel blocks, a quarter of each 16-wide head turning, biases everywhere
    "neox_parallel": lambda: transformers.GPTNeoXConfig(**NEOX, rotary_pct=0.25,
                                                        rotary_emb_base=5000),
    # sequential blocks, half of each head, no attention biases, a tied head
    "neox_sequential": lambda: transformers.GPTNeoXConfig(
        **NEOX, use_parallel_residual=False, rotary_pct=0.5, attention_bias=False,
        tie_word_embeddings=True),
    # grouped keys and values, half of each head turning
    "phi3": lambda: transformers.Phi3Config(
        **PHI3, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5}),
    # every head whole, a window of 5 keys
    "phi3_window": lambda: transformers.Phi3Config(**PHI3, sliding_window=5),
    # LongRoPE over an original context of 16 (max 64), half of each head turning: 17 tokens
    # take the long factors; factors exact in float32, as a GGUF file keeps them
    "phi3_longrope": lambda: transformers.Phi3Config(
        **PHI3, original_max_position_embeddings=16, rope_parameters=LONGROPE),
}
EXPECTED = {
    "neox_parallel": dict(parallel_block=True, rotary_dim=4, rope_theta=5000.0, norm="layernorm",
                          attn_bias=True, attn_out_bias=True, activation="gelu",
                          tie_embeddings=False),
    "neox_sequential": dict(parallel_block=False, rotary_dim=8, attn_bias=False,
                            attn_out_bias=False, tie_embeddings=True),
    "phi3": dict(parallel_block=False, rotary_dim=8, n_kv_heads=2, norm="rmsnorm", gated=True,
                 sliding_window=None),
    "phi3_window": dict(rotary_dim=None, sliding_window=5),
    "phi3_longrope": dict(rotary_dim=8, rope_scaling="longrope", rope_original_context=16,
                          rope_factor=4.0, rope_attention_factor=None,
                          rope_short_factors=(1.0, 1.25, 1.5, 2.0),
                          rope_long_factors=(1.0, 3.0, 6.0, 12.0)),
}
# The family export writes: a Phi-3 that turns every dimension is Mistral's block exactly.
EXPORTED_AS = {"neox_parallel": "gpt_neox", "neox_sequential": "gpt_neox", "phi3": "phi3",
               "phi3_window": "mistral", "phi3_longrope": "phi3"}


def _tokenizer() -> HFTokenizer:
    text = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen jugs"]
    return HFTokenizer.train_bpe(text * 20, VOCAB)


def _save(kind: str, folder):
    torch.manual_seed(1)
    config = CONFIGS[kind]()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    _tokenizer().save(folder / "tokenizer.json")
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = _save(request.param, folder)
    model, tokenizer = load_hf(folder)
    return request.param, folder, reference, model, tokenizer


def test_config_fields(pair):
    kind, _, _, model, _ = pair
    for field, value in EXPECTED[kind].items():
        assert getattr(model.config, field) == value, field


def test_logits_equal(pair):
    _, _, reference, model, _ = pair
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)


def test_16_greedy_tokens_equal_on_every_path(pair):
    """The module path, the quantized model's fused C++ step (partial rotary and the parallel
    block computed there) and the serving engine over either give transformers' tokens."""
    _, folder, reference, model, _ = pair
    prompt = [5, 17, 42, 99, 7, 3, 250]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        theirs = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=16, min_new_tokens=16)[0, len(prompt):].tolist()
    greedy = GenerationConfig(max_new_tokens=16, eos_ids=())
    assert generate(model, prompt, greedy).generated_ids == theirs
    quantized = quantize_model(load_hf(folder)[0], "none")
    assert fast_decode.can_build(quantized) == kernels.available()
    assert generate(quantized, prompt, greedy).generated_ids == theirs
    for runs in (model, quantized):
        engine = Engine(runs, None, EngineConfig(block_size=4, n_blocks=32))
        handle = engine.submit(prompt, RequestParams(max_new_tokens=16, eos_ids=()))
        engine.run_until_done()
        assert handle.result.generated_ids == theirs


@pytest.mark.usefixtures("kernels")
def test_the_fused_step_computes_the_family_in_every_format(pair):
    folder = pair[1]
    # LongRoPE's text stays within its original context of 16: the oracle steps one cache,
    # where generation computes a text crossing it again (test_longrope_* cover the crossing)
    new = 8 if pair[0] == "phi3_longrope" else 16
    check_fused_step(lambda: load_hf(folder)[0], [5, 17, 42, 99, 7, 3, 250], new)


def test_export_reads_back_in_transformers(pair, tmp_path):
    kind, _, reference, model, tokenizer = pair
    export_hf(model, tokenizer, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.model_type == EXPORTED_AS[kind]
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
    ours, _ = load_hf(tmp_path / "out")
    torch.testing.assert_close(ours.state_dict(), model.state_dict())


def _hf(kind: str) -> dict:
    return CONFIGS[kind]().to_dict()


@pytest.mark.parametrize(("kind", "change", "field"), [
    ("phi3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ("phi3", {"original_max_position_embeddings": 16, "rope_parameters": LONGROPE | {
        "short_factor": [1.0] * 3}}, "rope_short_factors"),  # 4 pairs turn
    ("phi3", {"hidden_act": "gelu"}, "hidden_act"),
    ("neox_parallel", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ("neox_parallel", {"hidden_act": "gelu_fast"}, "hidden_act"),
])
def test_what_is_not_computed_is_refused_by_name(kind, change, field):
    with pytest.raises(InputError) as error:
        config_from_hf(_hf(kind) | change)
    assert error.value.field == field
    assert "\n" not in str(error.value)


def test_partial_rotary_is_read_from_old_and_new_config_files():
    old = {"model_type": "gpt_neox", "vocab_size": VOCAB, "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
           "max_position_embeddings": 64, "rotary_pct": 0.5, "rotary_emb_base": 100}
    config = config_from_hf(old)
    assert (config.rotary_dim, config.rope_theta, config.parallel_block) == (8, 100.0, True)
    assert config_from_hf(json.loads(json.dumps(_hf("neox_parallel")))).rotary_dim == 4


def test_gguf_round_trip_equals_transformers(pair, tmp_path):
    """Exported as llama.cpp's gptneox / phi3 (the window: phi3) and read back: transformers'
    logits and greedy tokens (transformers' own GGUF reader reads neither partial rotary
    nor a window, so it is no oracle for these files)."""
    from gguf import GGUFReader

    from glassformer.formats.gguf import load_gguf
    from glassformer.formats.gguf_export import export_gguf

    kind, _, reference, model, tokenizer = pair
    path = export_gguf(model, tokenizer, tmp_path / "model.gguf")
    arch = bytes(GGUFReader(path).fields["general.architecture"].parts[-1]).decode()
    assert arch == {"gpt_neox": "gptneox", "phi3": "phi3"}[reference.config.model_type]
    ours, _ = load_gguf(path)
    # a file states LongRoPE's attention factor, derived here: √(1 + ln 4 / ln 16)
    assert ours.config == model.config.replace(norm_eps=ours.config.norm_eps,
                                               rope_attention_factor=ours.config.rope_attention_factor)
    assert ours.config.rope_attention_factor == (pytest.approx(1.5 ** 0.5) if kind == "phi3_longrope"
                                                 else None)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)
    prompt = [5, 17, 42, 99, 7, 3, 250]
    greedy = GenerationConfig(max_new_tokens=16, eos_ids=())
    assert generate(ours, prompt, greedy).generated_ids == generate(model, prompt, greedy).generated_ids


def test_gguf_refuses_what_a_gptneox_file_cannot_say(tmp_path):
    """A gptneox file's GELU is read as the exact one: the tanh form is refused by name."""
    from glassformer import ModelConfig, Transformer
    from glassformer.formats.gguf_export import export_gguf

    config = ModelConfig(vocab_size=VOCAB, context_length=16, d_model=32, n_layers=1, n_heads=2,
                         position="rope", rotary_dim=8, parallel_block=True, activation="gelu_tanh")
    with pytest.raises(InputError, match="activation: 'gelu_tanh' cannot be exported to GGUF"):
        export_gguf(Transformer(config), _tokenizer(), tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_gguf_blocks_kept_with_their_biases(tmp_path_factory, tmp_path):
    """A q8_0 NeoX file with its blocks kept as they are (biases beside them) computes what the
    same file dequantized computes, within the int8 activations' rounding."""
    from glassformer.formats.gguf import load_gguf
    from glassformer.formats.gguf_export import export_gguf

    folder = tmp_path_factory.mktemp("neox_q8")
    _save("neox_parallel", folder)
    model, tokenizer = load_hf(folder)
    path = export_gguf(model, tokenizer, tmp_path / "model.gguf", "q8_0")
    kept, dequantized = load_gguf(path, keep_blocks=True)[0], load_gguf(path)[0]
    assert kept.blocks[0].attn.qkv.bias is not None
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = dequantized(ids)
        assert (kept(ids) - expected).abs().max() <= 0.05 * expected.abs().max()


@pytest.mark.parametrize(("changes", "field"), [
    ({"rotary_dim": 5}, "rotary_dim"), ({"rotary_dim": 18}, "rotary_dim"),
    ({"rotary_dim": 4, "position": "learned"}, "rotary_dim"),
    ({"parallel_block": True, "norm_placement": "post"}, "parallel_block"),
    ({"rotary_dim": 2, "rope_scaling": "ntk", "rope_factor": 2.0}, "rope_scaling"),  # s^(d/(d-2))
])
def test_the_family_fields_refuse_what_they_cannot_mean(changes, field):
    from glassformer import ModelConfig

    base = dict(vocab_size=VOCAB, context_length=16, d_model=32, n_layers=1, n_heads=2,
                position="rope")
    assert ModelConfig(**base, rotary_dim=16, parallel_block=True).rotated_dim == 16
    with pytest.raises(InputError) as error:
        ModelConfig(**(base | changes))
    assert error.value.field == field


def test_longrope_switches_its_factors_as_transformers_does(tmp_path):
    """Phi-3's LongRoPE over an original context of 16: a pass up to 16 tokens turns by the
    short factors, a longer one by the long ones, forward by forward as transformers decides
    (the same cache, fed in chunks, holds keys of both sets); generation recomputes a text as
    it grows past 16, so cached greedy tokens equal uncached ones and transformers' on every
    path, the engine's chunked prefill included."""
    from transformers import DynamicCache

    from glassformer.model.kv_cache import KVCache

    reference = _save("phi3_longrope", tmp_path)
    model = load_hf(tmp_path)[0]
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        short, long = model(ids[:, :10]), model(ids)
        torch.testing.assert_close(short, reference(ids[:, :10]).logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(long, reference(ids).logits, atol=1e-4, rtol=1e-4)
        assert (short - long[:, :10]).abs().max() > 1e-2  # the switch changes the first tokens
        cache, theirs = KVCache(model.config, batch_size=1), DynamicCache(config=reference.config)
        for start, end in ((0, 7), (7, 16), (16, 17), (17, 30), (30, 31)):
            torch.testing.assert_close(model(ids[:, start:end], cache=cache),
                                       reference(ids[:, start:end], cache=theirs).logits,
                                       atol=1e-4, rtol=1e-4)
    greedy = GenerationConfig(max_new_tokens=16, eos_ids=())
    for prompt in (ids[0, :5].tolist(), ids[0, :20].tolist()):  # crossing 16 while decoding, or not
        prompt_ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = reference.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                          do_sample=False, max_new_tokens=16,
                                          min_new_tokens=16)[0, len(prompt):].tolist()
        uncached = generate(model, prompt, GenerationConfig(max_new_tokens=16, eos_ids=(),
                                                            use_cache=False)).generated_ids
        assert generate(model, prompt, greedy).generated_ids == uncached == expected
        engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=64, token_budget=8,
                                                  max_batch=4))
        handles = [engine.submit(prompt, RequestParams(max_new_tokens=16, eos_ids=())),
                   engine.submit(prompt, RequestParams(max_new_tokens=16, eos_ids=()))]
        engine.run_until_done()
        assert [h.result.generated_ids for h in handles] == [expected, expected]
    # a left-padded batch: each row's set by its own text, as if generated alone
    from glassformer.generation.generate import generate_batch

    prompts = [ids[0, :5].tolist(), ids[0, 5:25].tolist()]
    assert ([r.generated_ids for r in generate_batch(model, prompts, greedy)]
            == [generate(model, p, greedy).generated_ids for p in prompts])


def test_longrope_refuses_the_sink_policy():
    from glassformer.model.sink import SinkPolicy

    config = config_from_hf(_hf("phi3_longrope"))
    with pytest.raises(InputError) as error:
        SinkPolicy(sink_tokens=2, window=8).check(config)
    assert error.value.field == "rope_scaling"
