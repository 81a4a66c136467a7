import json
import re

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.cli import main
from glassformer.formats.checkpoint import write_checkpoint
from glassformer.formats.tokenizers import CharTokenizer
from glassformer.interpret.journey import collect_journey, render_html, summary
from glassformer.interpret.trace import run_with_cache

TEXT = "The cat sat"
TOKENIZER = CharTokenizer("".join(chr(c) for c in range(32, 127)))


def make(name: str, **changes) -> Transformer:
    torch.manual_seed(0)
    return Transformer(get_preset(name).replace(**changes)).eval()


@pytest.fixture(scope="module")
def journey():
    model = make("tiny-llama")
    return model, collect_journey(model, TOKENIZER, TEXT, top_k=5)


def test_sites_cover_the_whole_pass_with_shapes_and_stats(journey):
    model, data = journey
    T = len(TEXT)
    assert data["tokens"] == list(TEXT)
    assert [s["name"] for s in data["sites"]] == list(model.hooks.sites)
    q = next(s for s in data["sites"] if s["name"] == "blocks.1.attn.q")
    assert q["shape"] == [1, 4, T, 8] and q["dims"] == ["batch", "head", "pos", "d_head"]
    k = next(s for s in data["sites"] if s["name"] == "blocks.1.attn.k")
    assert k["shape"] == [1, 2, T, 8] and len(k["preview"]) == 2  # one preview per key/value head
    _, cache = run_with_cache(model, torch.tensor([TOKENIZER.encode(TEXT)]))
    for site in data["sites"]:
        t = cache[site["name"]]
        finite = t[torch.isfinite(t)]
        assert site["stats"]["mean"] == pytest.approx(float(finite.mean()), rel=1e-3, abs=1e-6)
        assert site["stats"]["max"] == pytest.approx(float(finite.max()), rel=1e-3)


def test_every_step_names_a_recorded_site(journey):
    model, data = journey
    names = {s["name"] for s in data["sites"]}
    steps = data["steps"]
    assert all(step["site"] in names for step in steps["input"] + steps["output"])
    for layer in range(model.config.n_layers):
        assert all(f"blocks.{layer}.{step['site']}" in names for step in steps["layer"])
    equations = [s["equation"] for s in steps["layer"]]
    assert "A = Q Kᵀ / √d_head" in equations and "α = softmax(A_masked)" in equations


def test_attention_is_sent_once_per_layer_and_head(journey):
    model, data = journey
    T = len(TEXT)
    ids = torch.tensor([TOKENIZER.encode(TEXT)])
    _, cache = run_with_cache(model, ids, names=lambda n: n.endswith("pattern"))
    assert len(data["attention"]) == model.config.n_layers
    for layer, heads in enumerate(data["attention"]):
        expected = cache[f"blocks.{layer}.attn.pattern"][0].reshape(model.config.n_heads, T * T)
        torch.testing.assert_close(torch.tensor(heads), expected, atol=5e-4, rtol=0)


def test_next_tokens_and_the_logit_lens_agree_with_the_model(journey):
    model, data = journey
    ids = torch.tensor([TOKENIZER.encode(TEXT)])
    logits = model(ids)[0].detach()
    probs = logits[-1].softmax(-1)
    top = probs.topk(5)
    assert [t["id"] for t in data["next_tokens"]] == top.indices.tolist()
    assert [t["prob"] for t in data["next_tokens"]] == pytest.approx(top.values.tolist(), rel=1e-3)
    assert len(data["logit_lens"]) == model.config.n_layers + 1
    assert data["logit_lens"][-1]["tokens"] == [TOKENIZER.decode([i]) for i in logits.argmax(-1).tolist()]


def test_decode_step_is_the_next_tokens_row_against_the_cache(journey):
    model, data = journey
    next_id = data["next_tokens"][0]["id"]
    ids = torch.tensor([TOKENIZER.encode(TEXT) + [next_id]])
    _, cache = run_with_cache(model, ids, names=lambda n: n.endswith("pattern"))
    step = data["decode_step"]
    assert step["token"] == data["next_tokens"][0]["token"]
    for layer, rows in enumerate(step["attention"]):
        expected = cache[f"blocks.{layer}.attn.pattern"][0, :, -1]  # (H, T + 1)
        torch.testing.assert_close(torch.tensor(rows), expected, atol=5e-4, rtol=0)


def test_attribution_is_complete_and_rollout_is_a_distribution(journey):
    _, data = journey
    a = data["attribution"]
    assert sum(a["rollout"]) == pytest.approx(1.0, abs=1e-3)
    assert sum(a["integrated_gradients"]) == pytest.approx(a["logit"] - a["baseline_logit"], abs=2e-3)


@pytest.mark.parametrize("name", ["tiny-gpt1", "tiny-bidirectional", "tiny-alibi"])
def test_other_architectures(name):
    model = make(name)
    data = collect_journey(model, TOKENIZER, TEXT, top_k=3, ig_steps=2)
    assert [s["name"] for s in data["sites"]] == list(model.hooks.sites)
    assert (data["decode_step"] is None) == (not model.config.causal)
    has_positions = "embed.positions" in {s["site"] for s in data["steps"]["input"]}
    assert has_positions == (model.config.position in ("learned", "sinusoidal"))


def test_html_is_self_contained_and_carries_the_data(journey):
    model, _ = journey
    data = collect_journey(model, TOKENIZER, "a</script><!--b", top_k=3, ig_steps=2)
    html = render_html(data)
    assert not re.search(r"https?://", html)
    assert not re.search(r"<(script|link|img)[^>]*\s(src|href)=(?!\"data:)", html)
    payload = re.search(r'<script id="journey-data" type="application/json">(.*?)</script>', html, re.S)
    assert json.loads(payload.group(1)) == data
    assert html.count("</script>") == 2  # the text's "</script>" was escaped


def test_a_thirty_layer_nine_head_report_stays_compact():
    model = make("tiny-llama", n_layers=30, n_heads=9, n_kv_heads=3, d_model=72)
    data = collect_journey(model, TOKENIZER, "The cat sat on the mat.", top_k=5, ig_steps=2)
    assert len(data["attention"]) == 30 and all(len(heads) == 9 for heads in data["attention"])
    assert len(render_html(data).encode()) < 2_000_000


def test_cli_json_summary(capsys):
    assert main(["journey", "--preset", "tiny-llama", TEXT, "--json", "--top-k", "4", "--ig-steps", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == list(TEXT) and len(out["next_tokens"]) == 4
    q = next(s for s in out["sites"] if s["name"] == "blocks.0.attn.q")
    assert q == {"name": "blocks.0.attn.q", "shape": [1, 4, len(TEXT), 8],
                 "dims": ["batch", "head", "pos", "d_head"], "stats": q["stats"]}
    assert set(q["stats"]) == {"mean", "std", "min", "max"}


def test_cli_writes_html_from_a_checkpoint(tmp_path, capsys):
    model = make("tiny-gpt2")
    folder = write_checkpoint(tmp_path / "ckpt", model, TOKENIZER, {})
    out = tmp_path / "journey.html"
    assert main(["journey", "--model", str(folder), TEXT, "-o", str(out), "--json", "--ig-steps", "2"]) == 0
    summary_out = json.loads(capsys.readouterr().out)
    expected = model(torch.tensor([TOKENIZER.encode(TEXT)]))[0, -1].argmax()
    assert summary_out["next_tokens"][0]["id"] == int(expected)
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent", "x"], "no model at"),
    (["--preset", "tiny-llama", "é"], "not in the tokenizer"),
    (["--preset", "tiny-llama", ""], "no tokens"),
    (["--preset", "tiny-llama", "x", "--top-k", "0"], "--top-k"),
    (["--preset", "tiny-llama", "x" * 40], "context_length"),
])
def test_cli_errors_are_one_line(argv, message, capsys):
    assert main(["journey", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glassformer: error:") and message in err and err.count("\n") == 1


def test_summary_drops_the_previews(journey):
    _, data = journey
    assert all("preview" not in s for s in summary(data)["sites"])
