"""GGUF tokenizers against llama.cpp's own tokenizer test set: every vocabulary of its
`models/ggml-vocab-*.gguf` gives llama.cpp's ids for every test text, or its kind is refused by
name. The texts are llama.cpp's hard cases: leading and repeated spaces, newlines and tabs,
digits, accents, CJK, emoji, bytes outside the vocabulary."""

import pytest

from glassformer.formats.gguf_file import GGUFFile
from glassformer.formats.gguf_tokenizer import PRE_SPLITS, from_gguf_metadata
from tests.llama_cpp_source import vocab_cases, vocab_dir

# the vocabularies of llama.cpp 0.3.36's test set that come with expected ids
TESTED = ("llama-spm", "llama-bpe", "phi-3", "qwen2", "qwen35", "gpt-2", "gemma-4", "starcoder",
          "refact", "falcon", "mpt", "command-r", "deepseek-coder", "deepseek-llm")
REFUSED = {"bert-bge": "'bert'"}  # WordPiece: no GGUF BERT family here


def _metadata(name: str) -> dict:
    with GGUFFile(vocab_dir() / f"ggml-vocab-{name}.gguf") as file:
        return dict(file.metadata)


@pytest.fixture(scope="module")
def tokenizers():
    return {}


def _tokenizer(tokenizers, name):
    if name not in tokenizers:
        tokenizers[name] = from_gguf_metadata(_metadata(name))
    return tokenizers[name]


@pytest.mark.parametrize("name", TESTED)
def test_every_text_gives_llama_cpps_ids(tokenizers, name):
    tokenizer = _tokenizer(tokenizers, name)
    cases = vocab_cases(vocab_dir() / f"ggml-vocab-{name}.gguf")
    assert len(cases) > 40
    wrong = [(text, ids) for text, ids in cases
             if tokenizer.tokenizer.encode(text, add_special_tokens=False).ids != ids]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, first {wrong[0]!r}"


@pytest.mark.parametrize("name", ["llama-spm", "llama-bpe", "qwen2", "gemma-4"])
def test_decoding_gives_the_text_back(tokenizers, name):
    tokenizer = _tokenizer(tokenizers, name)
    for text, ids in vocab_cases(vocab_dir() / f"ggml-vocab-{name}.gguf"):
        if "\ufffd" not in text:
            assert tokenizer.decode(ids) == text


@pytest.mark.parametrize(("name", "kind"), REFUSED.items())
def test_an_unsupported_kind_is_refused_by_name(name, kind):
    with pytest.raises(ValueError, match=f"unsupported GGUF tokenizer {kind}"):
        from_gguf_metadata(_metadata(name))


def test_an_unknown_pre_tokenizer_is_refused_by_name():
    meta = _metadata("gpt-2") | {"tokenizer.ggml.pre": "tekken"}
    assert "tekken" not in PRE_SPLITS
    with pytest.raises(ValueError, match="pre-tokenizer 'tekken'"):
        from_gguf_metadata(meta)


def test_bos_follows_llama_cpp_and_the_file(tokenizers):
    spm = _tokenizer(tokenizers, "llama-spm")
    assert spm.add_bos and spm.encode("Hi")[0] == spm.bos_id == 1
    assert _tokenizer(tokenizers, "llama-bpe").add_bos  # Llama 3: by default, as llama.cpp
    assert not _tokenizer(tokenizers, "gpt-2").add_bos
    meta = _metadata("llama-spm") | {"tokenizer.ggml.add_bos_token": False}
    assert from_gguf_metadata(meta).encode("Hi")[0] != 1


def test_end_of_turn_tokens_end_a_reply(tokenizers):
    llama3 = _tokenizer(tokenizers, "llama-bpe")
    vocab = llama3.tokenizer.get_vocab()
    assert {vocab["<|eot_id|>"], vocab["<|end_of_text|>"]} <= llama3.end_ids
    phi3 = _tokenizer(tokenizers, "phi-3")
    assert {32000, phi3.tokenizer.token_to_id("<|end|>")} <= phi3.end_ids
    assert _tokenizer(tokenizers, "gpt-2").end_ids == {50256}
    qwen2 = _tokenizer(tokenizers, "qwen2")  # its "</s>" is a plain token in the file
    closing = qwen2.tokenizer.token_to_id("</s>")
    assert closing in qwen2.end_ids and qwen2.encode("</s> text")[0] == closing  # as llama.cpp


def test_sentencepiece_special_tokens_in_text_start_a_new_piece(tokenizers):
    """As llama.cpp: the text after a control token gets its own leading space marker."""
    spm = _tokenizer(tokenizers, "llama-spm")
    plain = spm.tokenizer.encode
    ids = plain("Hello</s>world", add_special_tokens=False).ids
    assert ids == plain("Hello").ids + [2] + plain("world").ids
    assert spm.decode(plain(" 🦙 x\n\t y", add_special_tokens=False).ids) == " 🦙 x\n\t y"
