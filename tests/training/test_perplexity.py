import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from glassformer import ModelConfig, Transformer
from glassformer.formats.tokenizers import CharTokenizer
from glassformer.training.perplexity import corpus_ids, perplexity


def test_perplexity_is_exp_of_the_mean_loss_over_consecutive_windows():
    model = Transformer(ModelConfig(vocab_size=7, context_length=4, d_model=8, n_layers=1,
                                    n_heads=2)).eval()
    ids = np.arange(11) % 7  # two full windows of 4 (+1 target each); the tail is dropped
    result = perplexity(model, ids, batch_size=1)
    t = torch.as_tensor(ids)
    losses = [F.cross_entropy(model(t[s:s + 4][None])[0], t[s + 1:s + 5], reduction="sum")
              for s in (0, 4)]
    expected = float(sum(losses).detach()) / 8
    assert result["tokens"] == 8
    assert result["loss"] == pytest.approx(expected, rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(expected), rel=1e-6)


def test_corpus_ids_end_every_document_with_eot(tmp_path):
    (tmp_path / "a.txt").write_text("ab\nba\n")
    tok = CharTokenizer("ab")
    np.testing.assert_array_equal(corpus_ids(tmp_path / "a.txt", tok, "line"), [0, 1, 2, 1, 0, 2])
