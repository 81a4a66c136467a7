"""Qwen3 and OLMo 2 (query/key norms; OLMo 2's output norms): tiny random models built with
transformers' own config classes (the oracle), loaded by Glassformer: equal logits, 16 equal
greedy tokens, the engine equal to generate, exported back and read by transformers."""

from __future__ import annotations

import json

import pytest
import torch
from fused_paths import check_fused_step

from glassformer import ModelConfig, Transformer
from glassformer.errors import InputError
from glassformer.formats.export import export_hf
from glassformer.formats.huggingface import config_from_hf, load_hf
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.interpret.trace import capture
from glassformer.serving import Engine, EngineConfig, RequestParams

transformers = pytest.importorskip("transformers")
VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
CONFIGS = {
    # head_dim 12 x 6 heads is wider than hidden_size 48: Qwen3 sets it on its own
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=12, attention_bias=True,
                                              tie_word_embeddings=True),
    "qwen3_window": lambda: transformers.Qwen3Config(**COMMON, head_dim=8, use_sliding_window=True,
                                                     sliding_window=5, max_window_layers=0),
    "olmo2": lambda: transformers.Olmo2Config(**COMMON, tie_word_embeddings=False),
    "olmo2_linear_rope": lambda: transformers.Olmo2Config(
        **COMMON, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
}
EXPECTED = {"qwen3": ("head", "pre"), "qwen3_window": ("head", "pre"), "olmo2": ("all", "out"),
            "olmo2_linear_rope": ("all", "out")}


def _tokenizer() -> HFTokenizer:
    text = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen jugs",
            "call 1234 or 5678"]  # digits merged: GPT-2's split keeps "1234" whole, Qwen's not
    return HFTokenizer.train_bpe(text * 20, VOCAB)


def _save(kind: str, folder):
    torch.manual_seed(1)
    config = CONFIGS[kind]()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # every norm weight and bias its own value, so each one counts
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    _tokenizer().save(folder / "tokenizer.json")
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = _save(request.param, folder)
    model, tokenizer = load_hf(folder)
    return request.param, reference, model, tokenizer, folder


def test_config_fields(pair):
    kind, reference, model, _, _ = pair
    c = model.config
    assert (c.qk_norm, c.norm_placement) == EXPECTED[kind]
    assert c.head_dim == getattr(reference.config, "head_dim", 48 // 6)  # OLMo 2 has no field
    assert c.sliding_window == (5 if kind == "qwen3_window" else None)
    assert c.attn_bias == c.attn_out_bias == (kind == "qwen3")
    assert (model.lm_head.weight is model.embed.tokens.weight) == (kind == "qwen3")
    assert c.rope_scaling == ("linear" if kind == "olmo2_linear_rope" else "none")


def test_logits_equal(pair):
    _, reference, model, _, _ = pair
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)


def test_16_greedy_tokens_equal_and_the_engine_equals_generate(pair):
    _, reference, model, _, _ = pair
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    ours = generate(model, prompt, GenerationConfig(max_new_tokens=16, eos_ids=())).generated_ids
    ids = torch.tensor([prompt])
    with torch.no_grad():
        theirs = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=16, min_new_tokens=16)
    assert ours == theirs[0, len(prompt):].tolist()
    engine = Engine(model, None, EngineConfig(block_size=4, n_blocks=64))
    handle = engine.submit(prompt, RequestParams(max_new_tokens=16, eos_ids=()))
    engine.run_until_done()
    assert handle.result.generated_ids == ours


@pytest.mark.usefixtures("kernels")
def test_the_fused_step_computes_the_family_in_every_format(pair):
    """Query/key norms over each head or all heads, output norms: in the C++ step too."""
    folder = pair[4]
    check_fused_step(lambda: load_hf(folder)[0], [5, 17, 42, 99, 7, 3, 250, 11])


def test_export_reads_back_in_transformers(pair, tmp_path):
    kind, reference, model, tokenizer, _ = pair
    export_hf(model, tokenizer, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.model_type == kind.split("_")[0]
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
    reloaded, _ = load_hf(tmp_path / "out")
    assert reloaded.config == model.config
    torch.testing.assert_close(reloaded.state_dict(), model.state_dict())


def test_every_site_fires_in_order(pair):
    _, _, model, _, _ = pair
    with capture(model) as cache:
        model(torch.tensor([[1, 2, 3, 4]]))
    assert list(cache) == list(model.hooks.sites)
    c = model.config
    assert cache["blocks.1.attn.q_norm"].shape == (1, c.n_heads, 4, c.head_dim)
    assert cache["blocks.1.attn.k_norm"].shape == (1, c.kv_heads, 4, c.head_dim)
    out = c.norm_placement == "out"
    assert ("blocks.0.attn_out_norm" in cache) == out == ("blocks.0.norm1" not in cache)


def _hf(kind: str, **changes) -> dict:
    """config.json of a family as a dict, without the layer_types that transformers derives."""
    hf = CONFIGS[kind]().to_dict()
    hf.pop("layer_types", None)
    return hf | changes


@pytest.mark.parametrize("changes, field", [
    (dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), "max_window_layers"),
    (dict(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True,
          sliding_window=4), "layer_types"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_qwen3_settings_not_computed_are_refused_by_name(changes, field):
    with pytest.raises(InputError, match=field):
        config_from_hf(_hf("qwen3", **changes))


def test_olmo2_clip_qkv_is_refused_by_name():
    with pytest.raises(InputError, match="clip_qkv"):
        config_from_hf(_hf("olmo2", clip_qkv=8.0))


def test_qwen_window_on_no_layer_past_max_window_layers():
    """max_window_layers at or past the depth: no layer slides (transformers' layer_types)."""
    hf = _hf("qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert config_from_hf(hf).sliding_window is None
    assert config_from_hf(hf | {"max_window_layers": 0}).sliding_window == 4


def test_the_family_defaults_where_config_json_leaves_them_out():
    hf = {"model_type": "olmo2", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 32}
    assert config_from_hf(hf).norm_eps == transformers.Olmo2Config().rms_norm_eps
    qwen = config_from_hf(hf | {"model_type": "qwen3"})
    assert (qwen.head_dim, qwen.norm_eps) == (transformers.Qwen3Config().head_dim,
                                              transformers.Qwen3Config().rms_norm_eps)


@pytest.mark.parametrize("changes, field", [
    (dict(qk_norm="head", norm_placement="out"), "norm_placement"),
    (dict(qk_norm="all"), "norm_placement"),
    (dict(norm_placement="out"), "qk_norm"),
    (dict(qk_norm="head", mlp_bias=True), "mlp_bias"),
    (dict(qk_norm="head", attn_bias=True), "attn_bias"),
    (dict(qk_norm="all", norm_placement="out", sliding_window=4), "sliding_window"),
])
def test_export_refuses_what_neither_family_expresses(tmp_path, changes, field):
    config = ModelConfig(vocab_size=VOCAB, context_length=16, d_model=16, n_layers=1, n_heads=2,
                         position="rope", norm="rmsnorm", activation="silu", gated=True,
                         attn_bias=False, attn_out_bias=False, mlp_bias=False).replace(**changes)
    with pytest.raises(InputError, match=field):
        export_hf(Transformer(config), _tokenizer(), tmp_path / "out")


def test_qwen2_window_exports_to_every_layer(tmp_path):
    """A Qwen2 model with a window: every layer of the exported folder slides in transformers."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, context_length=32, d_model=32, n_layers=2, n_heads=4,
                         n_kv_heads=2, position="rope", norm="rmsnorm", activation="silu",
                         gated=True, attn_bias=True, attn_out_bias=False, mlp_bias=False,
                         sliding_window=4, init_std=0.2)
    model = Transformer(config).eval()
    export_hf(model, _tokenizer(), tmp_path / "out")
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager").eval()
    assert reference.config.layer_types == ["sliding_attention"] * 2
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reference(ids).logits, model(ids), atol=1e-4, rtol=1e-4)
    assert config_from_hf(hf).sliding_window == 4


GGUF_CONFIGS = {  # transformers reads qwen2 and qwen3 GGUF files (a qwen3 file's head_dim as 128)
    "qwen2": lambda: transformers.Qwen2Config(**(COMMON | dict(hidden_size=64, num_attention_heads=4)),
                                              tie_word_embeddings=True),  # rows of 32-value blocks
    "qwen3": lambda: transformers.Qwen3Config(**(COMMON | dict(hidden_size=64, num_attention_heads=2,
                                                               num_key_value_heads=1)), head_dim=128),
    "olmo2": CONFIGS["olmo2"],
}


@pytest.mark.parametrize("kind", list(GGUF_CONFIGS))
def test_gguf_round_trip_as_llama_cpp_names_it(kind, tmp_path, monkeypatch):
    from gguf import GGUFReader

    from glassformer.formats.gguf import load_gguf
    from glassformer.formats.gguf_export import export_gguf

    monkeypatch.setitem(CONFIGS, kind, GGUF_CONFIGS[kind])
    reference = _save(kind, tmp_path / "hf")
    model, tokenizer = load_hf(tmp_path / "hf")
    path = export_gguf(model, tokenizer, tmp_path / "model.gguf")
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == kind
    expected = {"qwen2": {"blk.1.attn_q.bias", "blk.1.attn_norm.weight"},
                "qwen3": {"blk.1.attn_q_norm.weight", "blk.1.attn_k_norm.weight"},
                "olmo2": {"blk.1.attn_q_norm.weight", "blk.1.post_attention_norm.weight",
                          "blk.1.post_ffw_norm.weight"}}[kind]
    assert expected <= names and ("blk.1.attn_norm.weight" in names) == (kind != "olmo2")
    ours, _ = load_gguf(path)
    assert ours.config == model.config.replace(norm_eps=ours.config.norm_eps)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        oracle = reference(ids).logits
        torch.testing.assert_close(ours(ids), oracle, atol=1e-4, rtol=1e-4)
    if kind != "olmo2":
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(theirs(ids).logits, oracle, atol=1e-4, rtol=1e-4)


def test_gguf_blocks_kept_with_qwen2_biases(tmp_path, monkeypatch):
    from glassformer.accel import QuantizedLinear
    from glassformer.formats.gguf import load_gguf
    from glassformer.formats.gguf_export import export_gguf

    monkeypatch.setitem(CONFIGS, "qwen2", GGUF_CONFIGS["qwen2"])
    _save("qwen2", tmp_path)
    model, tokenizer = load_hf(tmp_path)
    path = export_gguf(model, tokenizer, tmp_path / "model.gguf", "q8_0")
    kept, _ = load_gguf(path, keep_blocks=True)
    floats, _ = load_gguf(path)
    qkv = kept.blocks[1].attn.qkv
    assert isinstance(qkv, QuantizedLinear)
    torch.testing.assert_close(qkv.bias, model.blocks[1].attn.qkv.bias, rtol=0, atol=0)
    torch.testing.assert_close(floats.blocks[1].attn.qkv.bias, qkv.bias, rtol=0, atol=0)


def test_parameter_counts_and_info_show_the_pieces(pair, capsys):
    from glassformer.cli import main
    from glassformer.interpret.params import count_parameters

    kind, _, model, _, folder = pair
    counts = count_parameters(model)
    c = model.config
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    q_norm, k_norm = (c.n_heads * c.head_dim, c.kv_heads * c.head_dim) if c.qk_norm == "all" else (
        c.head_dim, c.head_dim)
    biases = (c.n_heads + 2 * c.kv_heads) * c.head_dim + c.d_model if c.attn_bias else 0
    assert counts["blocks.0.attention"] == (c.d_model * (c.n_heads + 2 * c.kv_heads) * c.head_dim
                                            + c.n_heads * c.head_dim * c.d_model + biases
                                            + q_norm + k_norm)
    assert counts["blocks.0.norms"] == 2 * c.d_model
    assert main(["info", "--model", str(folder), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["config"]
    assert (shown["qk_norm"], shown["norm_placement"]) == EXPECTED[kind]


def test_the_journey_shows_the_query_key_and_output_norms(pair):
    from glassformer.interpret.journey import collect_journey

    _, _, model, tokenizer, _ = pair
    data = collect_journey(model, tokenizer, "the quick brown fox", top_k=3, ig_steps=2)
    assert [s["name"] for s in data["sites"]] == list(model.hooks.sites)
    steps = [step["site"] for step in data["steps"]["layer"]]
    assert [f"blocks.0.{site}" for site in steps] == [
        name for name in list(model.hooks.sites) if name.startswith("blocks.0.")
        and name.removeprefix("blocks.0.") in steps]
    out = model.config.norm_placement == "out"
    assert {"attn.q_norm", "attn.k_norm"} <= set(steps)
    assert ("attn_out_norm" in steps) == ("mlp_out_norm" in steps) == out != ("norm1" in steps)
    q = next(step for step in data["steps"]["layer"] if step["site"] == "attn.q")
    assert q["equation"].startswith("Q = RoPE(Norm_Q(")


def test_compare_agrees_with_transformers_layer_by_layer(pair):
    from glassformer.interpret.compare import compare

    _, reference, model, _, _ = pair
    result = compare(model, reference, torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]))
    assert "blocks.1.attn.out" in [s.site for s in result.sites]
    assert result.first_failure is None, result.first_failure


def test_a_qwen2_pre_tokenizer_splits_as_transformers_reads_it(tmp_path, monkeypatch):
    """A GGUF whose tokenizer.ggml.pre is qwen2 (Qwen2.5, Qwen3 files): our tokenizer and
    transformers' GGUF tokenizer give the same ids (digits one by one, newline runs, marks)."""
    from glassformer.formats import gguf_export
    from glassformer.formats.gguf import load_gguf

    monkeypatch.setitem(CONFIGS, "qwen2", GGUF_CONFIGS["qwen2"])
    _save("qwen2", tmp_path / "hf")
    model, tokenizer = load_hf(tmp_path / "hf")
    monkeypatch.setattr(gguf_export, "_pre_tokenizer", lambda pre: "qwen2")
    path = gguf_export.export_gguf(model, tokenizer, tmp_path / "model.gguf")
    _, ours = load_gguf(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    text = "the fox's 1234 dogs!!\n\n  jumps   over\tthe lazy dog's box?"
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.encode(text) != tokenizer.encode(text)  # GPT-2's split: "1234" in fewer tokens
    assert ours.decode(ours.encode(text)) == text
