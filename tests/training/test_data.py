import json

import numpy as np
import pytest
import torch

from glassformer.formats.tokenizers import CharTokenizer, HFTokenizer
from glassformer.training.data import (
    TokenData,
    draw_starts,
    iter_documents,
    list_sources,
    token_dtype,
    windows,
    write_token_file,
)


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_documents_per_file_line_and_blank(tmp_path):
    a = _write(tmp_path / "a.txt", "one\ntwo\n\n  \nthree\n")
    b = _write(tmp_path / "b.txt", "four")
    assert list(iter_documents([a, b], "file")) == ["one\ntwo\n\n  \nthree\n", "four"]
    assert list(iter_documents([a, b], "line")) == ["one", "two", "three", "four"]
    assert list(iter_documents([a, b], "blank")) == ["one\ntwo", "three\n", "four"]


def test_sources_from_folder_sorted_and_errors(tmp_path):
    _write(tmp_path / "b.txt", "b")
    _write(tmp_path / "a.txt", "a")
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "c.txt", "c")
    assert [p.name for p in list_sources(tmp_path)] == ["a.txt", "b.txt", "c.txt"]
    with pytest.raises(FileNotFoundError, match="not found"):
        list_sources(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="empty"):
        list_sources(_write(tmp_path / "empty.txt", ""))


def test_token_file_joins_documents_with_eot(tmp_path):
    src = _write(tmp_path / "corpus.txt", "ab\nba\n")
    tok = CharTokenizer.train(["ab"])
    write_token_file(list_sources(src), tok, tmp_path / "tokens.bin", documents="line")
    meta = json.loads((tmp_path / "tokens.json").read_text())
    assert meta["dtype"] == "uint16" and meta["n_tokens"] == 6
    tokens = np.fromfile(tmp_path / "tokens.bin", dtype=np.uint16)
    np.testing.assert_array_equal(tokens, [0, 1, 2, 1, 0, 2])  # a b EOT b a EOT


def test_token_file_is_reused_until_inputs_change(tmp_path):
    src = _write(tmp_path / "corpus.txt", "abab")
    tok = CharTokenizer.train(["ab"])
    out = tmp_path / "tokens.bin"
    write_token_file([src], tok, out)
    before = out.stat().st_mtime_ns
    write_token_file([src], tok, out)
    assert out.stat().st_mtime_ns == before
    _write(src, "abababab")
    write_token_file([src], tok, out)
    assert json.loads((tmp_path / "tokens.json").read_text())["n_tokens"] == 9



@pytest.mark.parametrize("torn", ['{"dtype": "uint16", "n_to', "[1, 2]", ""])
def test_a_torn_token_description_makes_the_tokens_again(tmp_path, torn):
    """A run killed while writing tokens.json (or a file that holds no description) leaves the
    tokens to be made again, not a JSON error; the description is written whole."""
    src = _write(tmp_path / "corpus.txt", "abab")
    tok = CharTokenizer.train(["ab"])
    out = tmp_path / "tokens.bin"
    write_token_file([src], tok, out)
    (tmp_path / "tokens.json").write_text(torn)
    write_token_file([src], tok, out)
    assert json.loads((tmp_path / "tokens.json").read_text())["n_tokens"] == 5
    assert not list(tmp_path.glob("*.tmp"))

def test_dtype_follows_vocab_size():
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_large_vocab_is_stored_as_uint32(tmp_path):
    class Big(CharTokenizer):
        vocab_size = 70000

    src = _write(tmp_path / "c.txt", "abc")
    write_token_file([src], Big("abc"), tmp_path / "t.bin")
    assert json.loads((tmp_path / "t.json").read_text())["dtype"] == "uint32"
    np.testing.assert_array_equal(np.fromfile(tmp_path / "t.bin", np.uint32), [0, 1, 2, 3])


def test_split_windows_and_determinism(tmp_path):
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    src = _write(tmp_path / "c.txt", text)
    tok = CharTokenizer.train([text])
    write_token_file([src], tok, tmp_path / "t.bin")
    data = TokenData.open(tmp_path / "t.bin", context_length=8, val_fraction=0.1)
    assert len(data.train) == 901 and len(data.val) == 100
    g = torch.Generator().manual_seed(0)
    starts = draw_starts(len(data.train), 8, 5, g)
    x, y = windows(data.train, starts, 8)
    assert x.shape == y.shape == (5, 8) and x.dtype == torch.int64 and x.is_contiguous()
    full = torch.from_numpy(np.asarray(data.train, dtype=np.int64))
    for i, s in enumerate(starts.tolist()):
        torch.testing.assert_close(x[i], full[s:s + 8])
        torch.testing.assert_close(y[i], full[s + 1:s + 9])
    again = draw_starts(len(data.train), 8, 5, torch.Generator().manual_seed(0))
    torch.testing.assert_close(starts, again)
    assert int(starts.max()) + 9 <= len(data.train)


def test_corpus_shorter_than_a_window(tmp_path):
    src = _write(tmp_path / "c.txt", "abcdefghij" * 5)
    tok = CharTokenizer.train(["abcdefghij"])
    write_token_file([src], tok, tmp_path / "t.bin")
    with pytest.raises(ValueError, match="corpus too short"):
        TokenData.open(tmp_path / "t.bin", context_length=16)


def test_bpe_token_file(tmp_path):
    text = "the cat sat on the mat. " * 50
    src = _write(tmp_path / "c.txt", text)
    tok = HFTokenizer.train_bpe([text], vocab_size=270)
    write_token_file([src], tok, tmp_path / "t.bin")
    tokens = np.fromfile(tmp_path / "t.bin", np.uint16)
    assert tokens[-1] == tok.eos_id
    assert tok.decode(tokens[:-1].tolist()) == text
