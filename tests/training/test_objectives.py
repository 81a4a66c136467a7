"""Training objectives: span corruption trains tiny-t5 on tinyshakespeare (the loss falls, the
run resumes exactly, the checkpoint generates); each objective refuses the other kind of model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glassformer.data import tinyshakespeare
from glassformer.formats.checkpoint import load_model
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.model.encoder_decoder import EncoderDecoder
from glassformer.model.presets import get_preset
from glassformer.training.config import TrainConfig
from glassformer.training.loop import train
from glassformer.training.metrics import read_metrics
from glassformer.training.objectives import OBJECTIVES, get_objective
from glassformer.training.span import sentinel_ids, span_counts

SPAN = TrainConfig(objective="span", batch_size=8, max_iters=40, warmup_iters=4, lr=3e-3,
                   eval_interval=20, eval_iters=2, log_interval=1, sample_tokens=8, device="cpu")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "shakespeare-head.txt"
    path.write_text(tinyshakespeare().read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return path


def losses(out: Path) -> dict[int, float]:
    return {r["iter"]: r["train_loss"] for r in read_metrics(out / "metrics.jsonl") if "lr" in r}


def test_span_training_lowers_the_loss_and_resumes_exactly(corpus, tmp_path):
    model_config = get_preset("tiny-t5")
    summary = train(corpus, tmp_path / "run", model_config, SPAN, progress=False, echo=lambda s: None)
    curve = losses(tmp_path / "run")
    first, last = sum(curve[i] for i in (1, 2, 3)) / 3, sum(curve[i] for i in (38, 39, 40)) / 3
    assert last < first - 0.25, (first, last)  # from about ln(vocab) = 4.2
    assert summary["val_loss"] < first

    # Stopped at 4 and resumed: the same losses as the run straight through.
    short = SPAN.replace(max_iters=8, eval_interval=4, sample_tokens=0, lr_decay_iters=8)
    half = train(corpus, tmp_path / "half", model_config, short.replace(max_iters=4),
                 progress=False, echo=lambda s: None)
    assert half["iters"] == 4
    train(corpus, tmp_path / "half", model_config, short, resume=True, progress=False,
          echo=lambda s: None)
    train(corpus, tmp_path / "straight", model_config, short, progress=False, echo=lambda s: None)
    resumed, straight = losses(tmp_path / "half"), losses(tmp_path / "straight")
    assert [resumed[i] for i in range(5, 9)] == pytest.approx([straight[i] for i in range(5, 9)], rel=1e-5)

    model, tokenizer, _ = load_model(tmp_path / "run")
    assert isinstance(model, EncoderDecoder)
    assert model.config.decoder_start_id == tokenizer.eos_id
    n_spans = span_counts(model.config.context_length)[1]
    sentinels = sentinel_ids(tokenizer, n_spans)  # saved with the run
    source = tokenizer.encode("To be, or not ") + [int(sentinels[0])] + tokenizer.encode(" be")
    result = generate(model, source, GenerationConfig(max_new_tokens=6), tokenizer)
    assert 1 <= len(result.generated_ids) <= 6 and isinstance(result.text, str)


def test_objectives_refuse_the_other_kind_of_model(corpus, tmp_path):
    with pytest.raises(ValueError, match="objective: span corruption trains encoder-decoder"):
        train(corpus, tmp_path / "a", get_preset("tiny-gpt2"), SPAN, progress=False)
    with pytest.raises(ValueError, match="objective: clm trains decoder-only"):
        train(corpus, tmp_path / "b", get_preset("tiny-t5"), SPAN.replace(objective="clm"), progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_registry():
    assert set(OBJECTIVES) == {"clm", "span", "mlm"}
    with pytest.raises(ValueError, match="objective: unknown 'mlm2'"):
        get_objective("mlm2")
    with pytest.raises(ValueError, match="objective: choose clm, span or mlm"):
        TrainConfig(objective="mlm2")


def test_clm_batch_is_the_windows_unchanged():
    x, y = torch.arange(6).view(2, 3), torch.arange(1, 7).view(2, 3)
    clm = get_objective("clm")
    assert clm.draw_masks(2, 3, torch.Generator()) is None
    assert clm.batch(x, y, None) == (x, y)
