import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glassformer.formats.tokenizers import (
    EOT,
    CharTokenizer,
    HFTokenizer,
    load_tokenizer,
    train_tokenizer,
)

CORPUS = ["First Citizen:\nBefore we proceed any further, hear me speak.\n",
          "All:\nSpeak, speak. Ünïcode ✓ too\n"] * 20


def test_char_vocab_is_the_sorted_corpus_characters_plus_eot():
    tok = train_tokenizer("char", ["bca", "ab"])
    assert tok.chars == "abc"
    assert tok.vocab_size == 4 and tok.eos_id == 3 and tok.bos_id is None
    assert tok.encode("cab") == [2, 0, 1]
    assert tok.decode([2, 0, 3]) == "ca" + EOT


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet="".join(sorted(set("".join(CORPUS)))), max_size=80))
def test_char_round_trip(text):
    tok = CharTokenizer.train(CORPUS)
    ids = tok.encode(text)
    assert ids == [tok.chars.index(c) for c in text]
    assert tok.decode(ids) == text


def test_char_unknown_character_is_a_clear_error():
    tok = CharTokenizer.train(["abc"])
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("abz")


def test_char_empty_corpus_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        CharTokenizer.train(["", ""])


def test_char_save_load(tmp_path):
    tok = CharTokenizer.train(CORPUS)
    tok.save(tmp_path / "tokenizer.json")
    data = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["type"] == "char"
    back = load_tokenizer(tmp_path)
    assert isinstance(back, CharTokenizer)
    assert back.chars == tok.chars and back.eos_id == tok.eos_id
    np.testing.assert_array_equal(back.encode_array(CORPUS[1]), tok.encode_array(CORPUS[1]))


def test_bpe_trains_to_the_requested_size_and_round_trips(tmp_path):
    tok = train_tokenizer("bpe", CORPUS, vocab_size=300)
    assert tok.vocab_size == 300
    assert tok.decode([tok.eos_id]) == EOT
    text = "Speak, speak. Ünïcode ✓ and bytes never seen: ж"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode("utf-8"))  # merges were learned
    assert tok.decode(ids) == text  # byte-level: nothing is unknown
    tok.save(tmp_path / "tokenizer.json")
    back = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(back, HFTokenizer)
    assert back.encode(text) == ids and back.eos_id == tok.eos_id


def test_bpe_too_small_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer("bpe", CORPUS, vocab_size=200)


def test_unknown_kind():
    with pytest.raises(ValueError, match="char"):
        train_tokenizer("word", CORPUS)


def test_hf_tokenizer_reads_special_tokens_from_tokenizer_config(tmp_path):
    tok = train_tokenizer("bpe", CORPUS, vocab_size=280)
    tok.save(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": EOT}, "bos_token": EOT})
    )
    back = load_tokenizer(tmp_path)
    assert back.eos_id == back.bos_id == tok.eos_id


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)
