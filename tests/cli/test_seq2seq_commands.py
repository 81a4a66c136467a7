"""The command line on encoder-decoders: generate, info, export and train --objective span;
bad input gives one line and exit status 2."""

from __future__ import annotations

import json

import pytest
import torch

from glassformer.cli import main
from glassformer.data import tinyshakespeare
from glassformer.formats.export import export_hf
from glassformer.formats.huggingface import load_hf
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.model.encoder_decoder import EncoderDecoder
from glassformer.model.presets import get_preset

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = get_preset("tiny-t5").replace(vocab_size=300, init_std=0.2)
    tokenizer = HFTokenizer.train_bpe(["the quick brown fox jumps over a lazy dog"] * 9, 300)
    return export_hf(EncoderDecoder(config), tokenizer, tmp_path_factory.mktemp("m") / "t5")


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("glassformer: error: ")
    return err[0]


@pytest.mark.parametrize("flags, beams", [([], 1), (["--beams", "3"], 3), (["--no-cache"], 1)])
def test_generate_json_equals_the_library(t5_folder, capsys, flags, beams):
    code = main(["generate", "--model", str(t5_folder), "-n", "5", "--json", "--quantize", "none",
                 *flags, "the lazy dog"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    model, tokenizer = load_hf(t5_folder)
    prompt = tokenizer.encode("the lazy dog")
    expected = generate(model, prompt, GenerationConfig(max_new_tokens=5, beams=beams), tokenizer)
    assert out["prompt_ids"] == prompt and out["generated_ids"] == expected.generated_ids


def test_generate_streams_text(t5_folder, capsys):
    assert main(["generate", "--model", str(t5_folder), "-n", "4", "the quick fox"]) == 0
    captured = capsys.readouterr()
    assert "4 tokens" in captured.err or "stop: eos" in captured.err


def test_engine_and_slide_are_refused(t5_folder, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "the dog"}\n')
    assert main(["generate", "--model", str(t5_folder), "--prompts-file", str(prompts)]) == 2
    assert "serving engine runs decoder-only models" in one_error_line(capsys)
    assert main(["generate", "--model", str(t5_folder), "--slide", "the dog"]) == 2
    assert "overflow" in one_error_line(capsys)


def test_info_shows_both_stacks(capsys):
    assert main(["info", "--preset", "tiny-t5", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in info["stacks"]] == ["encoder", "decoder"]
    assert "cross-attention to the encoder" in info["stacks"][1]["sublayers"]
    assert info["parameters"]["decoder.blocks.1.cross_attention"] == 4 * 32 * 32
    assert main(["info", "--preset", "t5-small", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"]["total"] == 60_506_624  # as published


def test_export_round_trip_through_the_cli(t5_folder, tmp_path, capsys):
    assert main(["export", "--model", str(t5_folder), "-o", str(tmp_path / "again"), "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert "model.safetensors" in files and "tokenizer.json" in files
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "again").eval()
    ours, _ = load_hf(t5_folder)
    ids, decoder_ids = torch.tensor([[5, 9, 14, 2]]), torch.tensor([[0, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, decoder_ids),
                                   theirs(input_ids=ids, decoder_input_ids=decoder_ids).logits)


def test_bad_t5_files_give_one_line(t5_folder, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (bad / name).write_bytes((t5_folder / name).read_bytes())
    (bad / "model.safetensors").write_bytes((t5_folder / "model.safetensors").read_bytes()[:300])
    assert main(["generate", "--model", str(bad), "hi"]) == 2
    assert "corrupt or truncated safetensors" in one_error_line(capsys)
    config = json.loads((t5_folder / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"feed_forward_proj": "gated-swish"}))
    assert main(["generate", "--model", str(bad), "hi"]) == 2
    assert "unsupported T5 feed_forward_proj 'gated-swish'" in one_error_line(capsys)


def test_train_objective_span(tmp_path, capsys):
    data = tmp_path / "head.txt"
    data.write_text(tinyshakespeare().read_text(encoding="utf-8")[:5000], encoding="utf-8")
    code = main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--preset", "tiny-t5",
                 "--objective", "span", "--max-iters", "4", "--eval-interval", "4", "--eval-iters", "1",
                 "--batch-size", "4", "--sample-tokens", "4", "--device", "cpu", "--no-progress", "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["iters"] == 4 and summary["val_loss"] > 0
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "clm"), "--preset", "tiny-t5",
                 "--max-iters", "1", "--no-progress"]) == 2
    assert "objective: clm trains decoder-only models" in one_error_line(capsys)


def test_language_model_logits_and_trace(t5_folder):
    from glassformer import load

    lm = load(t5_folder)
    model, tokenizer = lm.model, lm.tokenizer
    source, target = tokenizer.encode("the lazy dog"), tokenizer.encode("a fox")
    with torch.no_grad():
        expected = model(torch.tensor([source]), torch.tensor([[0, *target]]))[0]
    torch.testing.assert_close(lm.logits("the lazy dog", target="a fox"), expected)
    logits, sites = lm.trace("the lazy dog", ["decoder.blocks.0.cross.pattern"], target="a fox")
    torch.testing.assert_close(logits[0], expected)
    assert sites["decoder.blocks.0.cross.pattern"].shape == (1, 4, 1 + len(target), len(source))
