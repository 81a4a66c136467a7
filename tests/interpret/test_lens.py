import json

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.cli import main
from glassformer.data import tinyshakespeare
from glassformer.errors import InputError
from glassformer.formats.checkpoint import write_checkpoint
from glassformer.formats.tokenizers import CharTokenizer
from glassformer.interpret.lens import (
    LensTraining,
    TunedLens,
    held_out,
    kl_curve,
    lens_logits,
    logit_lens,
    residual_sites,
    train_tuned_lens,
)
from glassformer.interpret.lens_page import lens_data, render_html
from glassformer.interpret.trace import run_with_cache

TEXT = tinyshakespeare().read_text(encoding="utf-8")[:12_000]
TOKENIZER = CharTokenizer("".join(chr(c) for c in range(32, 127)) + "\n")
PROMPT = "First Citizen"


def make(preset: str, **changes) -> Transformer:
    """A tiny model with random norm weights and biases (not the ones and zeros of init)."""
    torch.manual_seed(0)
    model = Transformer(get_preset(preset).replace(vocab_size=TOKENIZER.vocab_size, **changes)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    return model


def ids_of(text: str) -> torch.Tensor:
    return torch.tensor([TOKENIZER.encode(text)])  # (1, T)


# tiny-llama: RMSNorm, pre-norm, final norm; tiny-gpt2: LayerNorm, pre-norm, final norm;
# tiny-gpt1: LayerNorm, post-norm, no final norm (the last block's norm is the output's);
# tiny-bert: post-norm encoder whose head has its own transform.
PRESETS = ["tiny-llama", "tiny-gpt2", "tiny-gpt1", "tiny-bert"]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_last_residuals_lens_is_the_models_logits(preset):
    model = make(preset)
    ids = ids_of(PROMPT)
    logits, acts = run_with_cache(model, ids, names=residual_sites(model.config))
    read = lens_logits(model, [acts[site] for site in residual_sites(model.config)])
    assert len(read) == model.config.n_layers + 1
    torch.testing.assert_close(read[-1], logits, atol=1e-5, rtol=0)
    lens = logit_lens(model, ids, top_k=3)
    top = logits.softmax(-1).topk(3)
    assert torch.equal(lens.ids[-1], top.indices)
    torch.testing.assert_close(lens.probs[-1], top.values, atol=1e-6, rtol=0)


def test_an_inner_residual_reads_through_the_final_rmsnorm_and_the_head():
    model = make("tiny-llama")
    ids = ids_of(PROMPT)
    _, acts = run_with_cache(model, ids, names=["blocks.0.resid_post"])
    x = acts["blocks.0.resid_post"]
    h = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + model.config.norm_eps) * model.final_norm.weight
    expected = (h @ model.lm_head.weight.T).softmax(-1).topk(4)  # the plain math
    lens = logit_lens(model, ids, top_k=4)
    assert lens.sites[1] == "blocks.0.resid_post"
    assert torch.equal(lens.ids[1], expected.indices)
    torch.testing.assert_close(lens.probs[1], expected.values, atol=1e-6, rtol=0)


def test_an_untrained_tuned_lens_is_the_logit_lens():
    model = make("tiny-gpt2")
    ids = ids_of(PROMPT)
    tuned = TunedLens.for_model(model.config)
    torch.testing.assert_close(kl_curve(model, ids, tuned), kl_curve(model, ids), atol=1e-6, rtol=0)
    assert torch.equal(logit_lens(model, ids, 2, tuned).ids, logit_lens(model, ids, 2).ids)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt1"])
def test_a_trained_tuned_lens_is_closer_to_the_output_at_every_layer(preset):
    # init_std=0.3: peaked distributions that differ from layer to layer (0.02 gives near-uniform
    # ones, every lens within 1e-3 nats of the output)
    model = make(preset, init_std=0.3)
    tokens = torch.tensor(TOKENIZER.encode(TEXT))
    train, measure = held_out(tokens, model.config.context_length)
    settings = LensTraining(steps=25, batch=4, context=32, lr=1e-2)
    tuned = train_tuned_lens(model, train, settings)
    before, after = kl_curve(model, measure), kl_curve(model, measure, tuned)
    assert (before[:-1] > 0.1).all()  # held-out windows, far from the output before training
    assert (after[:-1] < before[:-1]).all(), (before, after)
    # the last residual is the output: both lenses read the final distribution exactly
    assert before[-1] == after[-1] == 0
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


def test_a_saved_tuned_lens_loads_the_same_and_refuses_another_model(tmp_path):
    model = make("tiny-llama")
    tuned = TunedLens.for_model(model.config)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    tuned.save(tmp_path / "lens", {"data": "somewhere"})
    loaded = TunedLens.load(tmp_path / "lens")
    for (name, a), (_, b) in zip(tuned.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    about = json.loads((tmp_path / "lens" / "tuned_lens.json").read_text())
    assert about == {"d_model": 32, "n_layers": 2, "data": "somewhere"}
    with pytest.raises(ValueError, match="n_layers"):
        loaded.check(get_preset("tiny-llama").replace(n_layers=3))
    with pytest.raises(FileNotFoundError, match="no tuned lens"):
        TunedLens.load(tmp_path)
    weights = tmp_path / "lens" / "tuned_lens.safetensors"
    weights.write_bytes(weights.read_bytes()[:-9])  # truncated
    with pytest.raises(InputError, match="tuned_lens.safetensors: corrupt or truncated"):
        TunedLens.load(tmp_path / "lens")


def test_top_k_and_training_settings_are_checked():
    model = make("tiny-llama")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="top_k"):
            logit_lens(model, ids_of(PROMPT), bad)
    with pytest.raises(ValueError, match="ids"):
        logit_lens(model, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="lr"):
        LensTraining(lr=float("nan"))
    with pytest.raises(ValueError, match="steps"):
        LensTraining(steps=0)


def test_the_heat_map_has_a_row_per_residual_and_a_cell_per_token():
    model = make("tiny-llama")
    ids = TOKENIZER.encode("a<b")
    lens = logit_lens(model, torch.tensor([ids]), top_k=3)
    data = lens_data(lens, ids, lambda i: TOKENIZER.decode([i]), tuned=False)
    page = render_html(data)
    assert page.count("<tr><th>blocks.") == model.config.n_layers and "<tr><th>embed.out</th>" in page
    assert page.count("<td ") == len(ids) * (model.config.n_layers + 1)
    assert "<th>a</th><th>&lt;</th><th>b</th>" in page  # tokens escaped
    assert "<script" not in page and "http" not in page  # self-contained
    top = data["layers"][-1]["top"][-1]
    assert [t["id"] for t in top] == lens.ids[-1, 0, -1].tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("lens") / "ckpt", make("tiny-llama"), TOKENIZER, {})


def test_cli_prints_a_table_and_json_that_agree_with_the_library(checkpoint, capsys):
    model = make("tiny-llama")
    lens = logit_lens(model, ids_of(PROMPT), top_k=2)
    assert main(["lens", "--model", str(checkpoint), PROMPT]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + model.config.n_layers + 1
    top = TOKENIZER.decode([int(lens.ids[2, 0, 0, 0])])
    assert lines[-1].split()[:2] == ["blocks.1.resid_post", repr(top)]
    assert main(["lens", "--model", str(checkpoint), PROMPT, "--json", "--top-k", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [layer["site"] for layer in data["layers"]] == residual_sites(model.config)
    got = torch.tensor([[[t["id"] for t in pos] for pos in layer["top"]] for layer in data["layers"]])
    assert torch.equal(got, lens.ids[:, 0])


def test_cli_trains_a_tuned_lens_and_reads_with_it(checkpoint, tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text(TEXT[:3000], encoding="utf-8")
    out = tmp_path / "tuned"
    argv = ["lens", "train", "--model", str(checkpoint), "--data", str(data), "--out", str(out),
            "--steps", "3", "--lens-context", "16", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["kl"]["tuned_lens"]) == 3 and report["training"]["steps"] == 3
    page = tmp_path / "lens.html"
    assert main(["lens", "--model", str(checkpoint), PROMPT, "--tuned", str(out), "--html", str(page),
                 "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    expected = logit_lens(make("tiny-llama"), ids_of(PROMPT), 5, TunedLens.load(out))
    assert shown["tuned"] and "Tuned lens" in page.read_text()
    assert [t["id"] for t in shown["layers"][0]["top"][0]] == expected.ids[0, 0, 0].tolist()


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model", PROMPT], "no model at"),
    (["--model", "CKPT", ""], "prompt: it encodes to no tokens"),
    (["--model", "CKPT", PROMPT, "--top-k", "0"], "--top-k"),
    (["--model", "CKPT", PROMPT, "--top-k", "many"], "--top-k"),
    (["--model", "CKPT", PROMPT, "--data", "x.txt"], "--data: only for"),
    (["train", "--model", "CKPT", "--out", "x"], "--data"),
    (["train", "--model", "CKPT", "--data", "x", "--out", "y", "--html", "z"], "--html: not for"),
    (["--model", "CKPT", PROMPT, "--tuned", "no-such-folder"], "no tuned lens"),
])
def test_cli_reports_bad_input_in_one_line(checkpoint, capsys, argv, message):
    argv = [str(checkpoint) if a == "CKPT" else a for a in argv]
    assert main(["lens", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
