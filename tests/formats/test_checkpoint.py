import json
import os

import pytest
import safetensors.torch
import torch

from glassformer import ModelConfig, Transformer
from glassformer.formats import checkpoint as ckpt
from glassformer.formats.tokenizers import CharTokenizer

CONFIG = ModelConfig(vocab_size=11, context_length=8, d_model=16, n_layers=1, n_heads=2)
TOKENIZER = CharTokenizer("abcdefghij")


def _model(seed):
    torch.manual_seed(seed)
    return Transformer(CONFIG)


def _trained_optimizer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    model(torch.arange(8)[None] % 11).sum().backward()
    opt.step()
    return opt


def test_round_trip_with_tied_weights_and_optimizer(tmp_path):
    model = _model(0)
    assert model.lm_head.weight is model.embed.tokens.weight
    opt = _trained_optimizer(model)
    rng = {"rng.torch": torch.get_rng_state()}
    ckpt.save_to_run(tmp_path, 3, ("latest",), model, TOKENIZER, {"state": {"step": 3}}, opt, rng)

    back, tokenizer, meta = ckpt.load_model(tmp_path)
    assert back.lm_head.weight is back.embed.tokens.weight  # still tied after loading
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert meta["state"]["step"] == 3 and meta["model"] == CONFIG.to_dict()
    assert tokenizer.chars == TOKENIZER.chars

    checkpoint = ckpt.Checkpoint.open(tmp_path / "latest")
    opt2 = torch.optim.AdamW(back.parameters(), lr=1.0)
    checkpoint.load_optimizer(opt2)
    sd1, sd2 = opt.state_dict(), opt2.state_dict()
    assert sd1["param_groups"] == sd2["param_groups"]
    for i in sd1["state"]:
        for k in sd1["state"][i]:
            torch.testing.assert_close(sd1["state"][i][k], sd2["state"][i][k])
    torch.testing.assert_close(checkpoint.training_state()["rng.torch"], rng["rng.torch"])


def test_latest_and_best_are_kept_apart_and_old_steps_removed(tmp_path):
    ckpt.save_to_run(tmp_path, 1, ("latest", "best"), _model(1), TOKENIZER, {})
    ckpt.save_to_run(tmp_path, 2, ("latest",), _model(2), TOKENIZER, {})
    ckpt.save_to_run(tmp_path, 3, ("latest",), _model(3), TOKENIZER, {})
    assert os.readlink(tmp_path / "best") == "step-0000001"
    assert os.readlink(tmp_path / "latest") == "step-0000003"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0000001", "step-0000003"]
    best, _, _ = ckpt.load_model(tmp_path / "best")
    torch.testing.assert_close(best.embed.tokens.weight, _model(1).embed.tokens.weight)


@pytest.mark.parametrize("failure", [OSError("disk full"), KeyboardInterrupt()])
def test_crash_mid_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, failure):
    good = _model(0)
    ckpt.save_to_run(tmp_path, 1, ("latest",), good, TOKENIZER, {"state": {"step": 1}})

    real = safetensors.torch.save_file

    def crash(tensors, filename, *args, **kwargs):
        real(tensors, filename)
        with open(filename, "r+b") as f:  # leave a torn file behind, then die
            f.truncate(20)
        raise failure

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(type(failure)):
        ckpt.save_to_run(tmp_path, 2, ("latest",), _model(5), TOKENIZER, {"state": {"step": 2}},
                         _trained_optimizer(_model(5)))
    monkeypatch.undo()

    model, _, meta = ckpt.load_model(tmp_path)
    assert meta["state"]["step"] == 1
    torch.testing.assert_close(model.embed.tokens.weight, good.embed.tokens.weight)
    assert not list(tmp_path.glob(".*tmp"))  # the partial folder is cleaned up


def test_leftover_of_a_hard_crash_is_ignored_and_replaced(tmp_path):
    ckpt.save_to_run(tmp_path, 1, ("latest",), _model(0), TOKENIZER, {})
    (tmp_path / ".step-0000002.tmp").mkdir()  # as if killed mid-write
    (tmp_path / "step-0000002").mkdir()  # as if killed between rename and link swap
    ckpt.save_to_run(tmp_path, 2, ("latest",), _model(2), TOKENIZER, {})
    model, _, _ = ckpt.load_model(tmp_path)
    torch.testing.assert_close(model.embed.tokens.weight, _model(2).embed.tokens.weight)


def test_wrong_shapes_and_missing_folder(tmp_path):
    ckpt.save_to_run(tmp_path, 1, ("latest",), _model(0), TOKENIZER, {})
    other = Transformer(CONFIG.replace(d_model=32))
    with pytest.raises(ValueError, match="do not fit"):
        ckpt.load_weights(other, tmp_path / "latest" / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no glassformer checkpoint"):
        ckpt.Checkpoint.open(tmp_path / "nothing")


def test_config_json_is_plain_json(tmp_path):
    ckpt.save_to_run(tmp_path, 1, ("latest",), _model(0), TOKENIZER, {"train": {"lr": 1e-3}})
    data = json.loads((tmp_path / "latest" / "config.json").read_text())
    assert data["train"] == {"lr": 1e-3} and data["model"]["d_model"] == 16
