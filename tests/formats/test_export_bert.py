"""Exporting an encoder: a BertForMaskedLM folder that transformers loads with equal logits,
from a loaded Hugging Face folder and from a Glassformer model; refusals name the field."""

from __future__ import annotations

import pytest
import torch
from bert_folder import VOCAB, save_bert

from glassformer import Transformer, get_preset, load
from glassformer.cli import main
from glassformer.formats.export import export_hf, hf_config
from glassformer.formats.tokenizers import CharTokenizer

transformers = pytest.importorskip("transformers")


def _ids(vocab, seed=0):
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(seed))


def test_loaded_folder_round_trips_through_transformers(tmp_path, capsys):
    reference = save_bert(tmp_path / "in", seed=7)
    assert main(["export", "--model", str(tmp_path / "in"), "-o", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    again = transformers.BertForMaskedLM.from_pretrained(tmp_path / "out").eval()
    ids, types = _ids(VOCAB), (torch.arange(11) > 5).long().expand(2, 11)
    with torch.no_grad():
        torch.testing.assert_close(again(ids, token_type_ids=types).logits,
                                   reference(ids, token_type_ids=types).logits, atol=1e-5, rtol=1e-5)
    fill = transformers.pipeline("fill-mask", model=str(tmp_path / "out"), device="cpu", top_k=3)
    ours = load(tmp_path / "out").fill_mask("to be or [MASK] to be", top_k=3)[0]
    assert [c.token_id for c in ours.candidates] == [e["token"] for e in fill("to be or [MASK] to be")]


def test_glassformer_model_exports_with_its_pooler(tmp_path):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny-bert")).eval()
    export_hf(model, CharTokenizer("".join(chr(32 + i) for i in range(94)), mask_token="[MASK]"),
              tmp_path / "out")
    theirs = transformers.BertModel.from_pretrained(tmp_path / "out").eval()
    masked = transformers.BertForMaskedLM.from_pretrained(tmp_path / "out").eval()
    ids = _ids(96, seed=1)
    with torch.no_grad():
        h = model.forward_hidden(ids)
        torch.testing.assert_close(masked(ids).logits, model(ids), atol=1e-5, rtol=1e-5)
        out = theirs(ids)
        torch.testing.assert_close(out.last_hidden_state, h, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.pooler_output, model.pool(h), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, field", [({"n_token_types": 0}, "n_token_types"),
                                           ({"norm_placement": "pre"}, "norm_placement"),
                                           ({"head": "lm"}, "head")])
def test_configs_bert_cannot_express_are_refused(change, field):
    with pytest.raises(ValueError, match=field):
        hf_config(get_preset("tiny-bert").replace(**change))
