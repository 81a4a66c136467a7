"""Objectives and BERT's masking: the masking statistics, the loss over chosen positions
only (against the cross-entropy written plainly), the checks, and masked-LM training."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from glassformer import Transformer, get_preset
from glassformer.data import tinyshakespeare
from glassformer.formats.checkpoint import load_model
from glassformer.formats.tokenizers import CharTokenizer, load_tokenizer
from glassformer.training.config import TrainConfig
from glassformer.training.loop import train
from glassformer.training.masking import IGNORE, apply_masks, draw_choices, with_mask_token
from glassformer.training.metrics import read_metrics
from glassformer.training.objectives import OBJECTIVES

MLM = OBJECTIVES["mlm"]

VOCAB, MASK_ID = 1000, 999


def mask_tokens(ids, mask_id, vocab, generator):
    return apply_masks(ids, draw_choices(*ids.shape, generator), mask_id, vocab)


def _masked(seed=0, shape=(200, 500)):
    ids = torch.randint(0, MASK_ID, shape, generator=torch.Generator().manual_seed(123))
    inputs, targets = mask_tokens(ids, MASK_ID, VOCAB, torch.Generator().manual_seed(seed))
    return ids, inputs, targets


def test_masking_statistics():
    ids, inputs, targets = _masked()
    chosen = targets != IGNORE
    n = chosen.sum().item()
    assert abs(n / ids.numel() - 0.15) < 0.006  # 100 000 positions: σ ≈ 0.0011
    masked = (inputs == MASK_ID) & chosen
    kept = (inputs == ids) & chosen
    swapped = chosen & ~masked & ~kept  # a random token that differs from the original
    assert abs(masked.sum().item() / n - 0.8) < 0.015
    assert abs(kept.sum().item() / n - 0.1) < 0.012  # (+ 0.1% random draws of the same id)
    assert abs(swapped.sum().item() / n - 0.1) < 0.012
    torch.testing.assert_close(targets[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])  # unchosen positions are read as they are
    assert not (inputs[~chosen] == MASK_ID).any()


def test_masking_is_reproducible_from_the_generator():
    _, a, ta = _masked(seed=5, shape=(4, 64))
    _, b, tb = _masked(seed=5, shape=(4, 64))
    _, c, _ = _masked(seed=6, shape=(4, 64))
    assert torch.equal(a, b) and torch.equal(ta, tb) and not torch.equal(a, c)


def test_loss_counts_the_chosen_positions_only():
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny-bert")).eval()
    ids = torch.randint(0, 95, (3, 32), generator=torch.Generator().manual_seed(1))
    inputs, targets = mask_tokens(ids, 95, 96, torch.Generator().manual_seed(2))
    with torch.no_grad():
        logp = F.log_softmax(model(inputs), dim=-1)  # (B, T, vocab)
        chosen = targets != IGNORE
        expected = -logp[chosen].gather(1, targets[chosen][:, None]).mean()
        torch.testing.assert_close(MLM.loss(model, (inputs, targets)), expected)
        total = MLM.loss(model, (inputs, targets), reduction="sum")
        torch.testing.assert_close(total, expected * chosen.sum())


def test_the_objective_batch_masks_the_windows_with_the_drawn_choices():
    tokenizer = with_mask_token(CharTokenizer("abcdefgh"))
    x = torch.randint(0, 8, (3, 16), generator=torch.Generator().manual_seed(4))
    choices = MLM.draw_masks(3, 16, torch.Generator().manual_seed(5))
    inputs, targets = MLM.batch(x, x.roll(-1, 1), tokenizer, choices)
    expected = apply_masks(x, choices, tokenizer.mask_id, tokenizer.vocab_size)
    assert torch.equal(inputs, expected[0]) and torch.equal(targets, expected[1])


def test_objective_checks_name_the_problem():
    with pytest.raises(ValueError, match="mlm trains a bidirectional"):
        MLM.check(get_preset("tiny-gpt2"))
    with pytest.raises(ValueError, match="mlm trains a bidirectional"):
        MLM.check(get_preset("tiny-t5"))
    with pytest.raises(ValueError, match="mask token"):
        MLM.batch(torch.zeros(1, 4, dtype=torch.long), None, CharTokenizer("abc"),
                  torch.zeros(1, 4, 3))
    with pytest.raises(ValueError, match="objective"):
        TrainConfig(objective="nsp")


def test_char_tokenizer_mask_token_round_trip(tmp_path):
    tok = with_mask_token(CharTokenizer.train(["ab c"]))
    assert (tok.vocab_size, tok.eos_id, tok.mask_id) == (6, 4, 5)
    ids = tok.encode("a [MASK]b")
    assert ids == [1, 0, 5, 2] and tok.decode(ids) == "a [MASK]b"
    tok.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert again.mask_id == 5 and again.encode("[MASK]") == [5]
    assert CharTokenizer("ab").mask_id is None


def _mlm_config(**changes):
    return TrainConfig(batch_size=8, max_iters=40, warmup_iters=4, eval_interval=40, eval_iters=4,
                       log_interval=1, sample_tokens=20, device="cpu", lr=3e-3,
                       objective="mlm").replace(**changes)


def test_mlm_training_lowers_the_loss(tmp_path):
    data = tmp_path / "shakespeare.txt"
    data.write_text(tinyshakespeare().read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    model = get_preset("tiny-bert")
    summary = train(data, tmp_path / "run", model, _mlm_config(), progress=False)
    losses = [r["train_loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "lr" in r]
    first = sum(losses[:3]) / 3
    assert first > math.log(40)  # near ln(vocab) = ln(67) at the start
    assert summary["val_loss"] < first - 0.5
    trained, tokenizer, _ = load_model(tmp_path / "run" / "latest")
    assert tokenizer.mask_id == tokenizer.vocab_size - 1 and not trained.config.causal


def test_mlm_resumed_equals_uninterrupted(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(tinyshakespeare().read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    model, config = get_preset("tiny-bert"), _mlm_config(max_iters=6, lr_decay_iters=6,
                                                         eval_interval=3)
    train(data, tmp_path / "full", model, config, progress=False)
    train(data, tmp_path / "part", model, config.replace(max_iters=3), progress=False)
    train(data, tmp_path / "part", model, config, resume=True, progress=False)
    full, _, _ = load_model(tmp_path / "full")
    part, _, _ = load_model(tmp_path / "part")
    for name, tensor in full.state_dict().items():
        torch.testing.assert_close(part.state_dict()[name], tensor, msg=name)


def test_next_token_perplexity_refuses_an_encoder():
    from glassformer.training.perplexity import perplexity

    with pytest.raises(ValueError, match="encoder"):
        perplexity(Transformer(get_preset("tiny-bert")), np.arange(40) % 90)


def test_bpe_tokenizer_gets_a_special_mask_token():
    from glassformer.formats.tokenizers import HFTokenizer

    tok = with_mask_token(HFTokenizer.train_bpe(["to be or not to be"] * 5, 270))
    assert tok.mask_id == tok.vocab_size - 1 and tok.encode("to [MASK] be")[1:2] != []
    assert tok.mask_id in tok.encode("to [MASK] be") and with_mask_token(tok) is tok
