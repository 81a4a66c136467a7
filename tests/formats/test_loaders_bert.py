"""BERT folders: a tiny random BertForMaskedLM built with transformers (the oracle), saved,
loaded by Glassformer; equal logits (fp32) with segments and padding; every error path."""

from __future__ import annotations

import json

import pytest
import torch
from bert_folder import VOCAB, save_bert, wordpiece
from safetensors.torch import load_file, save_file

from glassformer import load
from glassformer.formats.huggingface import config_from_hf, load_hf

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    reference = save_bert(folder)
    model, tokenizer = load_hf(folder)
    return folder, reference, model, tokenizer


def _ids(B=2, T=13, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def test_logits_equal(pair):
    _, reference, model, _ = pair
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_logits_equal_with_token_types(pair):
    _, reference, model, _ = pair
    ids = _ids(seed=1)
    types = (torch.arange(13) >= 6).long().expand(2, 13)  # (B, T): two segments
    with torch.no_grad():
        ours = model(ids, token_types=types)
        theirs = reference(ids, token_type_ids=types).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours, model(ids))  # the segments matter


def test_logits_equal_with_right_padding(pair):
    _, reference, model, _ = pair
    ids = _ids(seed=2)
    valid = torch.ones(2, 13, dtype=torch.bool)
    valid[1, 9:] = False  # the second row is 9 tokens + 4 padding
    with torch.no_grad():
        ours = model(ids, pad_mask=valid)
        theirs = reference(ids, attention_mask=valid.long()).logits
        alone = model(ids[1:, :9])
    torch.testing.assert_close(ours[valid], theirs[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[1, :9], alone[0], atol=1e-5, rtol=1e-5)


def test_config_and_load_entry_point(pair):
    folder, reference, model, tokenizer = pair
    c = model.config
    assert (c.causal, c.norm_placement, c.head, c.n_token_types, c.embed_norm) == (
        False, "post", "mlm", 2, True)
    assert model.lm_head.weight is model.embed.tokens.weight
    assert tokenizer.mask_id == 4 and tokenizer.vocab_size == VOCAB
    lm = load(folder)
    ids = _ids(1, 7)
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_untied_decoder_loads(tmp_path):
    reference = save_bert(tmp_path, tie_word_embeddings=False)
    model, _ = load_hf(tmp_path)
    assert model.lm_head.weight is not model.embed.tokens.weight
    ids = _ids(seed=3)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_pooler_equals_bert_model(tmp_path):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=32, initializer_range=0.2)
    config._attn_implementation = "eager"
    pretraining = transformers.BertForPreTraining(config).eval()
    masked = transformers.BertForMaskedLM(config).eval()
    masked.bert.load_state_dict(pretraining.bert.state_dict(), strict=False)
    masked.cls.load_state_dict(pretraining.cls.predictions.state_dict(), strict=False)
    masked.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors |= {f"bert.pooler.dense.{k}": v.contiguous()
                for k, v in pretraining.bert.pooler.dense.state_dict().items()}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    wordpiece().save(str(tmp_path / "tokenizer.json"))
    model, _ = load_hf(tmp_path)
    ids = _ids(2, 9, seed=4)
    with torch.no_grad():
        theirs = pretraining.bert(ids)
        torch.testing.assert_close(model.pool(model.forward_hidden(ids)), theirs.pooler_output,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    ({"is_decoder": True}, "is_decoder"),
    ({"hidden_act": "swish2"}, "hidden_act"),
    ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
])
def test_unsupported_config_is_one_error(change, message):
    base = {"model_type": "bert", "vocab_size": 10, "max_position_embeddings": 8, "hidden_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16}
    with pytest.raises(ValueError, match=message):
        config_from_hf(base | change)


def test_missing_field_is_one_error():
    with pytest.raises(ValueError, match="lacks 'max_position_embeddings'"):
        config_from_hf({"model_type": "bert", "vocab_size": 10})


def test_bad_tensors_are_refused(pair, tmp_path):
    folder = pair[0]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    tensors = load_file(folder / "model.safetensors")
    missing = {k: v for k, v in tensors.items() if k != "cls.predictions.bias"}
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensor cls.predictions.bias"):
        load_hf(tmp_path)
    wrong = dict(tensors, **{"bert.embeddings.token_type_embeddings.weight": torch.zeros(3, 48)})
    save_file(wrong, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="token_type_embeddings.weight has shape"):
        load_hf(tmp_path)
    extra = dict(tensors, **{"cls.seq_relationship.weight": torch.zeros(2, 48)})
    save_file(extra, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor cls.seq_relationship.weight"):
        load_hf(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"hidden_size": 40}))
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="shape"):
        load_hf(tmp_path)
