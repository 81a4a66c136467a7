"""Steering vectors (build, save, load), whole-batch steering and head ablation against plain
reference math, and `glassformer steer build` / `generate --steer` against the library."""

import json

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.cli import main
from glassformer.formats.checkpoint import write_checkpoint
from glassformer.formats.tokenizers import CharTokenizer
from glassformer.generation.config import Steer
from glassformer.interpret.steer import SteeringVector, build_vector, steered
from glassformer.interpret.trace import run_with_cache
from glassformer.model.sites import parse_head

TOKENIZER = CharTokenizer("".join(chr(c) for c in range(32, 127)) + "\n")
POSITIVE = ["what a lovely day", "great work, thanks"]
NEGATIVE = ["what an awful day", "terrible work"]
SITE = "blocks.1.resid_post"


def make() -> Transformer:
    torch.manual_seed(0)
    return Transformer(get_preset("tiny-llama").replace(vocab_size=TOKENIZER.vocab_size, init_std=0.3)).eval()


def _ids(texts):
    return [TOKENIZER.encode(t) for t in texts]


def test_the_vector_is_the_mean_difference_over_every_token_of_each_prompt():
    model = make()
    vector = build_vector(model, SITE, _ids(POSITIVE), _ids(NEGATIVE), "tiny")

    def side(texts):  # each prompt's mean over its tokens, then the mean over prompts
        acts = [run_with_cache(model, torch.tensor([ids]), names=[SITE])[1][SITE][0] for ids in _ids(texts)]
        return torch.stack([a.mean(dim=0) for a in acts]).mean(dim=0)

    torch.testing.assert_close(vector.vector, side(POSITIVE) - side(NEGATIVE))
    assert vector.site == SITE and vector.model == "tiny"


def test_a_saved_vector_loads_the_same_and_bad_files_are_refused(tmp_path):
    vector = build_vector(make(), SITE, _ids(POSITIVE), _ids(NEGATIVE), "tiny")
    path = vector.save(tmp_path / "v.safetensors")
    again = SteeringVector.load(path)
    assert torch.equal(again.vector, vector.vector) and (again.site, again.model) == (SITE, "tiny")
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="not a steering vector"):
        SteeringVector.load(tmp_path / "junk.safetensors")
    SteeringVector(torch.full((4,), float("nan")), SITE, "x").save(tmp_path / "nan.safetensors")
    with pytest.raises(ValueError, match="non-finite"):
        SteeringVector.load(tmp_path / "nan.safetensors")


def test_steered_adds_alpha_v_and_ablation_zeroes_one_head():
    model = make()
    ids = torch.tensor([TOKENIZER.encode("hello there")])
    v = torch.randn(model.config.d_model, generator=torch.Generator().manual_seed(1))
    site, head = "blocks.0.attn.context", 1  # where blocks.0.attn.head.1 is, and which
    named = parse_head("blocks.0.attn.head.1")
    assert (named.site.full, named.index) == (site, head)
    _, plain = run_with_cache(model, ids, names=[SITE, site])
    with steered(model, [Steer(SITE, v, 2.0)]):
        _, cache = run_with_cache(model, ids, names=[SITE])
    torch.testing.assert_close(cache[SITE], plain[SITE] + 2.0 * v)
    with steered(model, ablate=["blocks.0.attn.head.1"]):
        _, cache = run_with_cache(model, ids, names=[site])
    expected = plain[site].clone()
    expected[:, head] = 0  # (B, H, T, d_head)
    assert torch.equal(cache[site], expected)
    with steered(model, [Steer(SITE, v, 0.0)]):  # α = 0 installs nothing
        assert not model.hooks


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("steer")
    (folder / "pos.txt").write_text("\n".join(POSITIVE) + "\n")
    (folder / "neg.txt").write_text("\n".join(NEGATIVE) + "\n")
    return folder, write_checkpoint(folder / "ckpt", make(), TOKENIZER, {})


def test_cli_builds_the_vector_and_generate_steers_with_it(files, capsys):
    folder, checkpoint = files
    out = folder / "v.safetensors"
    argv = ["steer", "build", "--model", str(checkpoint), "--site", SITE, "--positive",
            str(folder / "pos.txt"), "--negative", str(folder / "neg.txt"), "--out", str(out), "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["width"] == make().config.d_model
    vector = SteeringVector.load(out)
    model = make()
    built = build_vector(model, SITE, _ids(POSITIVE), _ids(NEGATIVE))
    torch.testing.assert_close(vector.vector, built.vector)
    prompt = "the day was"
    assert main(["generate", "--model", str(checkpoint), prompt, "-n", "8", "--ignore-eos", "--json",
                 "--steer", f"{out}:6"]) == 0
    got = json.loads(capsys.readouterr().out)["generated_ids"]

    def greedy(steers):
        ids = TOKENIZER.encode(prompt)
        with steered(model, steers), torch.no_grad():
            for _ in range(8):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        return ids[-8:]

    assert got == greedy([vector.steer(6.0)]) != greedy([])


@pytest.mark.parametrize("argv, message", [
    (["--site", "blocks.9.resid_post"], "steer: the model has no site"),
    (["--site", "blocks.0.attn.q"], "steer: 'blocks.0.attn.q' is"),
])
def test_cli_reports_bad_input_in_one_line(files, capsys, argv, message, tmp_path):
    folder, checkpoint = files
    base = ["steer", "build", "--model", str(checkpoint), "--positive", str(folder / "pos.txt"),
            "--negative", str(folder / "neg.txt"), "--out", str(tmp_path / "x.safetensors")]
    assert main(base + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.parametrize("spec, message", [("joy", "give NAME=PATH"),
                                           ("joy=missing.safetensors", "not a steering")])
def test_serve_refuses_a_bad_steer_before_loading(files, capsys, spec, message):
    _, checkpoint = files
    assert main(["serve", "--model", str(checkpoint), "--steer", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_generate_refuses_a_bad_alpha(files, capsys):
    folder, checkpoint = files
    spec = f"{folder / 'v.safetensors'}:nan"  # ALPHA is checked before the file is read
    assert main(["generate", "--model", str(checkpoint), "hi", "--steer", spec]) == 2
    assert "ALPHA" in capsys.readouterr().err
