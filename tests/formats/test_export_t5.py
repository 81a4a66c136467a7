"""T5 export: a Glassformer encoder-decoder written as a Hugging Face folder loads back into
transformers (the oracle) with equal logits; configs T5 cannot express are refused."""

from __future__ import annotations

import json

import pytest
import torch

from glassformer.formats.export import export_hf, hf_config
from glassformer.formats.huggingface import load_hf_model
from glassformer.model.encoder_decoder import EncoderDecoder
from glassformer.model.presets import get_preset

transformers = pytest.importorskip("transformers")
from t5_folders import VERSIONS, VOCAB, save_t5  # noqa: E402  (tests/ is on the path)


def logits_both(ours, folder):
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(folder).eval()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(2, ours.config.vocab_size, (2, 9), generator=g)
    decoder_ids = torch.randint(2, ours.config.vocab_size, (2, 5), generator=g)
    with torch.no_grad():
        return ours(ids, decoder_ids), theirs(input_ids=ids, decoder_input_ids=decoder_ids).logits


@pytest.mark.parametrize("version", list(VERSIONS))
def test_loaded_t5_round_trips(tmp_path, version):
    save_t5(version, tmp_path / "in")
    model = load_hf_model(tmp_path / "in")
    export_hf(model, None, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["tie_word_embeddings"] == (version == "v1.0")
    ours, theirs = logits_both(model, tmp_path / "out")
    torch.testing.assert_close(ours, theirs)
    assert ours.shape[-1] == VOCAB


@pytest.mark.parametrize("tied", [True, False])
def test_trained_preset_exports(tmp_path, tied):
    config = get_preset("tiny-t5").replace(  # v1.0's shape when tied, v1.1's when not
        tie_embeddings=tied, scale_head_input=tied, activation="relu" if tied else "gelu_tanh",
        gated=not tied)
    torch.manual_seed(0)
    model = EncoderDecoder(config).eval()
    export_hf(model, None, tmp_path / "out")
    torch.testing.assert_close(*logits_both(model, tmp_path / "out"))


@pytest.mark.parametrize("change, field", [
    (dict(position="sinusoidal"), "position"),
    (dict(norm_placement="post"), "norm_placement"),
    (dict(scale_scores=True), "scale_scores"),
    (dict(activation="silu", gated=False), "activation"),
])
def test_what_t5_cannot_express_is_refused(change, field):
    with pytest.raises(ValueError, match=f"^{field}: .* cannot be exported as T5"):
        hf_config(get_preset("tiny-t5").replace(**change))


def test_transformer_base_is_refused():
    with pytest.raises(ValueError, match="cannot be exported as T5"):
        hf_config(get_preset("transformer-base"))
