"""Gemma, Gemma 2 and Gemma 3: tiny random models built by transformers' own config classes
(the oracle), loaded by Glassformer: equal logits, layer by layer too, the same greedy tokens
from generate and from the serving engine, and the exported folder and GGUF file read back."""

import copy
import json

import pytest
import torch
from fused_paths import check_fused_step

from glassformer.formats.export import export_hf
from glassformer.formats.gguf import load_gguf
from glassformer.formats.gguf_export import export_gguf, gguf_metadata
from glassformer.formats.huggingface import config_from_hf, load_hf_model
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.model.transformer import Transformer
from glassformer.serving import Engine, EngineConfig, RequestParams

transformers = pytest.importorskip("transformers")

VOCAB = 300
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, head_dim=12, max_position_embeddings=64,
             initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {
    "gemma": lambda: transformers.GemmaConfig(**SIZES, num_hidden_layers=2),
    # a window shorter than the prompt, soft-caps that bite, a score scale other than head_dim
    "gemma2": lambda: transformers.Gemma2Config(
        **SIZES, num_hidden_layers=3, sliding_window=5, query_pre_attn_scalar=20,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    # what a GGUF file can say: llama.cpp's even sliding layers, scores times head_dim^-½
    "gemma2-gguf": lambda: transformers.Gemma2Config(
        **{**SIZES, "head_dim": 256}, num_hidden_layers=3, sliding_window=5,
        query_pre_attn_scalar=256),
    "gemma2-layer-types": lambda: transformers.Gemma2Config(
        **SIZES, num_hidden_layers=3, sliding_window=4, attention_bias=True,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    # seven layers: the sixth global (Gemma3TextConfig's pattern), the seventh sliding; RoPE
    # bases per kind, the global layers' scaled (linear, 8) in transformers 4's words; a final
    # soft-cap (Gemma 3 has none by default)
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SIZES, num_hidden_layers=7, sliding_window=5, query_pre_attn_scalar=20,
        rope_theta=1000.0, rope_local_base_freq=50.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, final_logit_softcapping=3.0),
    # what a GGUF file can say: llama.cpp's pattern, base 10000 for the sliding layers, scores
    # times head_dim^-½
    "gemma3-gguf": lambda: transformers.Gemma3TextConfig(
        **{**SIZES, "head_dim": 256}, num_hidden_layers=7, sliding_window=5,
        query_pre_attn_scalar=256),
}


def _save(name, folder):
    torch.manual_seed(3)
    config = CONFIGS[name]()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norm weights away from their zero init, so the +1 offset is tested
        for key, tensor in model.state_dict().items():
            if "norm" in key:
                tensor.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, _save(request.param, folder), load_hf_model(folder), folder


IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))


def test_logits_equal(pair):
    _, reference, model, _ = pair
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), reference(IDS).logits, atol=1e-5, rtol=1e-4)


def test_bfloat16_logits_equal(pair):
    """In bfloat16 the embedding scale, the (1 + w) norms in float32 and the soft-caps round
    as transformers rounds them: bit for bit where both run attention written plainly (the
    reference kernel here, eager there; sdpa rounds otherwise)."""
    _, reference, _, folder = pair
    loaded = load_hf_model(folder, torch.bfloat16)
    model = Transformer(loaded.config.replace(attention_kernel="reference")).to(torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    with torch.no_grad():
        theirs = copy.deepcopy(reference).to(torch.bfloat16)(IDS).logits
        torch.testing.assert_close(model(IDS), theirs, atol=0.0, rtol=0.0)


def test_greedy_tokens_of_generate_and_the_engine_equal_transformers(pair):
    _, reference, model, _ = pair
    prompt = IDS[0, :12]
    with torch.no_grad():
        theirs = reference.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]),
                                    do_sample=False, max_new_tokens=16,
                                    min_new_tokens=16)[0, 12:].tolist()
    greedy = GenerationConfig(max_new_tokens=16, eos_ids=())
    assert generate(model, prompt.tolist(), greedy).generated_ids == theirs
    assert generate(model, prompt.tolist(), GenerationConfig(
        max_new_tokens=16, eos_ids=(), use_cache=False)).generated_ids == theirs
    for attention in ("reference", "fast"):
        engine = Engine(model, None, EngineConfig(attention=attention, block_size=4, n_blocks=64,
                                                  token_budget=8, max_batch=4))
        handle = engine.submit(prompt.tolist(), RequestParams(max_new_tokens=16, eos_ids=()))
        engine.run_until_done()
        assert handle.result.generated_ids == theirs, attention


@pytest.mark.usefixtures("kernels")
def test_the_fused_step_computes_the_family_in_every_format(pair):
    """(1 + w) norms, the embedding scale, sandwich norms, soft-capped scores, the score scale,
    each layer's window and Gemma 3's RoPE base per kind of layer: in the C++ step too."""
    folder = pair[3]
    check_fused_step(lambda: load_hf_model(folder), IDS[0, :12].tolist())


def test_config_fields(pair):
    name, _, model, _ = pair
    c = model.config
    assert (c.norm_weight_offset, c.embed_scale, c.activation, c.gated) == (
        1.0, True, "gelu_tanh", True)
    if name == "gemma":
        assert (c.norm_placement, c.attn_softcap, c.layer_windows) == ("pre", None, None)
    if name in ("gemma2", "gemma2-gguf"):
        assert c.layer_windows == (5, None, 5)  # Gemma2Config: the even layers slide
    if name == "gemma2":
        assert (c.norm_placement, c.attn_scale, c.attn_softcap, c.final_softcap) == (
            "sandwich", 20.0, 2.0, 3.0)
    if name == "gemma2-layer-types":
        assert c.layer_windows == (None, 4, 4) and c.attn_bias and c.attn_out_bias
    if name.startswith("gemma3"):
        assert (c.norm_placement, c.qk_norm) == ("sandwich", "head")
        assert c.layer_windows == (5, 5, 5, 5, 5, None, 5)
    if name == "gemma3":
        assert (c.rope_theta, c.rope_local_theta, c.rope_scaling, c.rope_factor) == (
            1000.0, 50.0, "linear", 8.0)
        assert (c.attn_scale, c.attn_softcap, c.final_softcap) == (20.0, None, 3.0)
    if name == "gemma3-gguf":
        assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (1e6, 1e4, "none")
        assert (c.attn_softcap, c.final_softcap) == (None, None)


def test_gemma3_reads_either_rope_layout():
    """transformers 5 writes rope_parameters keyed by layer type, 4.x rope_theta,
    rope_local_base_freq and rope_scaling (the global layers'): the same config either way."""
    new = CONFIGS["gemma3"]().to_dict()
    assert set(new["rope_parameters"]) == {"full_attention", "sliding_attention"}
    old = {key: value for key, value in new.items() if key not in ("rope_parameters", "layer_types")}
    old |= {"rope_theta": 1000.0, "rope_local_base_freq": 50.0, "sliding_window_pattern": 6,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert config_from_hf(json.loads(json.dumps(old))) == config_from_hf(json.loads(json.dumps(new)))


def test_export_reads_back_in_transformers(pair, tmp_path):
    name, reference, model, _ = pair
    export_hf(model, None, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.model_type == reference.config.model_type
    with torch.no_grad():
        torch.testing.assert_close(again(IDS).logits, reference(IDS).logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("kind", "change", "field"), [
    ("gemma2", {"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
     "layer_types"),
    ("gemma2", {"hidden_activation": "relu"}, "hidden_activation"),
    ("gemma", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"sliding_window": None}, "sliding_window"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", {"attn_logit_softcapping": 2.0}, "attn_logit_softcapping"),
    ("gemma3", {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters"),
    ("gemma3", {"layer_types": None, "sliding_window_pattern": 0}, "sliding_window_pattern"),
])
def test_a_math_changing_field_not_computed_is_refused_by_name(kind, change, field):
    hf = CONFIGS[kind]().to_dict()
    hf = json.loads(json.dumps({**hf, **change}))
    with pytest.raises(ValueError) as error:
        config_from_hf(hf)
    assert error.value.field == field


def _tokenizer():
    text = "the quick brown fox jumps over the lazy dog. pack my box with five dozen jugs. " * 30
    return HFTokenizer.train_bpe([text] * 4, VOCAB)


def test_gguf_round_trip_computes_what_transformers_computes(pair, tmp_path):
    """Exported as llama.cpp names it (gemma, gemma2: norms stored as 1 + w) and read back:
    the same logits as transformers; a Gemma 2 llama.cpp cannot say is refused by name."""
    name, reference, model, _ = pair
    path = tmp_path / "model.gguf"
    if name == "gemma3":  # refused field by field until it is what llama.cpp computes
        config = model.config
        for field, value in (("attn_scale", 12.0), ("rope_local_theta", 10000.0)):
            with pytest.raises(ValueError) as error:
                gguf_metadata(config)
            assert error.value.field == field
            config = config.replace(**{field: value})
        meta = gguf_metadata(config)  # the global layers' scaling and the final soft-cap said
        assert (meta["gemma3.rope.scaling.type"], meta["gemma3.rope.scaling.factor"]) == ("linear", 8.0)
        assert meta["gemma3.final_logit_softcapping"] == 3.0
        return
    if name in ("gemma2", "gemma2-layer-types"):
        field = "attn_scale" if name == "gemma2" else "attn_bias"  # the first field refused
        with pytest.raises(ValueError) as error:
            export_gguf(model, _tokenizer(), path)
        assert error.value.field == field and not path.exists()
        if name == "gemma2-layer-types":  # a global first layer: llama.cpp slides on layer 0
            with pytest.raises(ValueError) as error:
                gguf_metadata(model.config.replace(attn_bias=False, attn_out_bias=False, attn_scale=12.0))
            assert error.value.field == "layer_windows"
        return
    export_gguf(model, _tokenizer(), path)
    again, _ = load_gguf(path)
    assert again.config.replace(norm_eps=model.config.norm_eps) == model.config  # eps in float32
    with torch.no_grad():
        torch.testing.assert_close(again(IDS), reference(IDS).logits, atol=1e-5, rtol=1e-4)
    if name in ("gemma2-gguf", "gemma3-gguf"):  # transformers reads these GGUF files too
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
        with torch.no_grad():
            torch.testing.assert_close(theirs(IDS).logits, reference(IDS).logits, atol=1e-5, rtol=1e-4)


def test_compare_agrees_with_transformers_layer_by_layer(pair):
    from glassformer.interpret.compare import compare

    _, reference, model, _ = pair
    result = compare(model, reference, torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]))
    assert f"blocks.{model.config.n_layers - 1}.attn.out" in [s.site for s in result.sites]
    assert result.first_failure is None, result.first_failure
