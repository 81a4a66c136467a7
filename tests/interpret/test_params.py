import json

import torch

from glassformer import Transformer, get_preset
from glassformer.cli import main
from glassformer.interpret.params import count_parameters


def _meta_model(name):
    with torch.device("meta"):
        return Transformer(get_preset(name))


def test_gpt1_embedding_is_dv_plus_dc():
    counts = count_parameters(_meta_model("gpt1"))
    d, v, c = 768, 40478, 512
    assert counts["token_embedding"] + counts["positions"] == d * v + d * c
    assert counts["lm_head"] == 0  # tied: counted once, in the embedding


def test_counts_match_the_formula_per_block():
    config = get_preset("llama")
    counts = count_parameters(_meta_model("llama"))
    d, dh, H, KV, f = config.d_model, config.head_dim, config.n_heads, config.kv_heads, config.ff_dim
    assert counts["blocks.0.attention"] == d * (H + 2 * KV) * dh + H * dh * d
    assert counts["blocks.0.feedforward"] == 3 * d * f
    assert counts["blocks.0.norms"] == 2 * d
    model = _meta_model("llama")
    assert counts["total"] == sum(p.numel() for p in model.parameters())  # unique parameters


def test_untied_head_is_counted():
    config = get_preset("tiny-gpt2").replace(tie_embeddings=False, lm_head_bias=True)
    counts = count_parameters(Transformer(config))
    assert counts["lm_head"] == config.vocab_size * (config.d_model + 1)


def test_info_command_json(capsys):
    assert main(["info", "--preset", "gpt2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["n_layers"] == 12
    assert 124_000_000 < report["parameters"]["total"] < 125_000_000  # GPT-2 small: 124M


def test_info_command_bad_preset(capsys):
    assert main(["info", "--preset", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glassformer: error: unknown preset") and err.count("\n") == 1


def test_bert_base_counts_every_parameter_and_shows_its_stack(capsys):
    counts = count_parameters(_meta_model("bert"))
    d, v, c = 768, 30522, 512
    assert counts["token_types"] == 2 * d and counts["embed_norm"] == 2 * d
    assert counts["head_transform"] == d * d + d + 2 * d and counts["pooler"] == d * d + d
    assert counts["lm_head"] == v  # the decoder's bias; its weight is the token embedding
    assert counts["token_embedding"] + counts["positions"] == d * (v + c)
    assert counts["total"] == sum(p.numel() for p in _meta_model("bert").parameters())
    assert main(["info", "--preset", "tiny-bert", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stacks"][0]["name"] == "encoder"
    assert main(["info", "--preset", "tiny-bert"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[:3] == ["encoder", "2", "blocks:"]
