"""Training from a pretrained model (TrainConfig.init): a tiny Llama built in transformers (the
oracle) and saved as a Hugging Face folder, or a Glassformer checkpoint, is the starting point;
the run's first evaluation is the oracle's own loss, resume is exact, contradictions refused."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from llama_folder import TEXT, llama_folder

from glassformer.cli import main
from glassformer.formats.checkpoint import load_model
from glassformer.formats.huggingface import load_hf
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.model.config import ModelConfig
from glassformer.training.config import TrainConfig
from glassformer.training.data import TokenData, draw_starts
from glassformer.training.loop import train
from glassformer.training.metrics import read_metrics
from glassformer.training.pretrained import run_config

pytest.importorskip("transformers")
TRAIN = TrainConfig(batch_size=4, max_iters=2, warmup_iters=0, eval_interval=2, eval_iters=2,
                    log_interval=1, sample_tokens=4, device="cpu", lr=1e-3)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, llama_folder(folder)


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_first_evaluation_is_the_pretrained_models_loss(hf, corpus, tmp_path):
    folder, reference = hf
    out = tmp_path / "run"
    frozen = TRAIN.replace(init=str(folder), lr=0.0, min_lr=0.0, max_iters=1, eval_interval=1)
    summary = train(corpus, out, {"context_length": 16}, frozen, progress=False)

    # the data is the pretrained tokenizer's ids, each document followed by its end-of-text
    tokenizer = HFTokenizer.load(folder / "tokenizer.json")
    tokens = TokenData.open(out / "tokens.bin", 16, frozen.val_fraction)
    stored = torch.cat([torch.as_tensor(tokens.train.astype("int64")),
                        torch.as_tensor(tokens.val.astype("int64"))])
    assert stored.tolist() == tokenizer.encode(TEXT) + [tokenizer.eos_id]

    # the loop's validation windows, scored by the transformers model
    starts = draw_starts(len(tokens.val), 16, frozen.eval_iters * frozen.batch_size,
                         torch.Generator().manual_seed(frozen.seed + 1))
    val = torch.as_tensor(tokens.val.astype("int64"))
    x = torch.stack([val[s:s + 16] for s in starts.tolist()])
    y = torch.stack([val[s + 1:s + 17] for s in starts.tolist()])
    with torch.no_grad():
        logits = reference(x).logits
    expected = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert summary["val_loss"] == pytest.approx(expected, rel=1e-5)

    # lr 0: the saved weights are the pretrained ones; the config is its own but the window
    model, saved_tokenizer, meta = load_model(out / "latest")
    pretrained, _ = load_hf(folder)
    assert model.config == pretrained.config.replace(context_length=16)
    for name, value in pretrained.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)
    assert saved_tokenizer.encode(TEXT[:40]) == tokenizer.encode(TEXT[:40])
    assert meta["train"]["init"] == str(folder)


def test_from_a_checkpoint_resumes_exactly(hf, corpus, tmp_path):
    folder, _ = hf
    start = tmp_path / "start"
    train(corpus, start, {"context_length": 16}, TRAIN.replace(init=str(folder)), progress=False)
    config = TRAIN.replace(init=str(start / "latest"), max_iters=4, lr_decay_iters=4)
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(corpus, whole, None, config, progress=False)
    train(corpus, split, None, config.replace(max_iters=2), progress=False)
    train(corpus, split, None, config, resume=True, progress=False)
    a, _, _ = load_model(whole / "latest")
    b, _, _ = load_model(split / "latest")
    for name, value in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[name], value, rtol=0, atol=0)
    first, _, _ = load_model(start / "latest")
    assert not torch.equal(first.blocks[0].attn.qkv.weight, a.blocks[0].attn.qkv.weight)
    losses = [r["train_loss"] for r in read_metrics(whole / "metrics.jsonl") if "lr" in r]
    assert len(losses) == 4 and all(v == v for v in losses)


def test_run_config_keeps_the_pretrained_fields():
    base = ModelConfig(vocab_size=50, context_length=32, d_model=16, n_layers=1, n_heads=2,
                       position="rope")
    assert run_config(base, None, "m") == base
    assert run_config(base, base, "m") == base
    assert run_config(base, {"dropout": 0.1, "context_length": 8}, "m") == \
        base.replace(dropout=0.1, context_length=8)
    with pytest.raises(ValueError, match=r"^init: m fixes .*n_layers=4 \(it has 1\)"):
        run_config(base, {"n_layers": 4, "dropout": 0.1}, "m")
    with pytest.raises(ValueError, match="^context_length: 64 is longer"):
        run_config(base, {"context_length": 64}, "m")
    with pytest.raises(ValueError, match="^context_length: m has learned positions"):
        run_config(base.replace(position="learned"), {"context_length": 8}, "m")
    with pytest.raises(ValueError, match="^bogus: not a ModelConfig field"):
        run_config(base, {"bogus": 1}, "m")


def test_cli_init_trains_and_refuses_contradictions(hf, corpus, tmp_path, capsys):
    folder, _ = hf
    out = tmp_path / "run"
    args = ["train", "--init", str(folder), "--data", str(corpus), "--out", str(out),
            "--context-length", "16", "--batch-size", "2", "--eval-iters", "1",
            "--sample-tokens", "0", "--no-progress"]
    assert main([*args, "--n-layers", "4", "--max-iters", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--n-layers=4 (it has 2)" in err[0]
    assert not out.exists()  # nothing written
    assert main([*args, "--preset", "shakespeare-char", "--max-iters", "1"]) == 2
    assert "fixes the model" in capsys.readouterr().err
    assert not out.exists()

    assert main([*args, "--max-iters", "2", "--eval-interval", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["iters"] == 2 and summary["tokens_seen"] == 2 * 2 * 16
    assert main(["train", "--data", str(corpus), "--out", str(out), "--resume", "--max-iters",
                 "3", "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iters"] == 3
    saved = json.loads((out / "latest" / "config.json").read_text())
    assert saved["train"]["init"] == str(folder) and saved["model"]["n_layers"] == 2


@pytest.mark.slow
def test_smollm2_fine_tunes_a_few_steps(smollm2_path, corpus, tmp_path):
    from glassformer import load

    config = TRAIN.replace(init=str(smollm2_path), batch_size=1, max_iters=2, eval_iters=1,
                           sample_tokens=0, lr=1e-4)
    summary = train(corpus, tmp_path / "run", {"context_length": 32}, config, progress=False)
    assert summary["iters"] == 2 and summary["val_loss"] < 10
    tuned, base = load(tmp_path / "run"), load(smollm2_path)
    assert tuned.config == base.config.replace(context_length=32)
    assert tuned.tokenizer.encode("Hello there") == base.tokenizer.encode("Hello there")
    assert tuned.tokenizer.chat_template == base.tokenizer.chat_template
