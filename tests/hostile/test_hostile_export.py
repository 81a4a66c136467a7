"""`export --to hf` keeps what it read: the special tokens a folder names besides BOS and EOS
(pad and unk) reach the exported config.json and tokenizer_config.json, as transformers reads
both folders."""

from __future__ import annotations

import json

import pytest
import torch
from hostile_helpers import LLAMA
from tokenizers import Tokenizer

from glassformer import Transformer
from glassformer.cli import main
from glassformer.formats.export import export_hf
from glassformer.formats.tokenizers import HFTokenizer

transformers = pytest.importorskip("transformers")


def _source(folder):
    """A Hugging Face Llama folder whose tokenizer names <pad> and <unk>, as Gemma's does."""
    torch.manual_seed(0)
    tokenizer = HFTokenizer.train_bpe(["the quick brown fox jumps over the lazy dog"] * 9, 300)
    export_hf(Transformer(LLAMA.replace(vocab_size=300)), tokenizer, folder)
    table = Tokenizer.from_file(str(folder / "tokenizer.json"))
    table.add_special_tokens(["<pad>", "<unk>"])  # the last ids of the vocabulary
    table.save(str(folder / "tokenizer.json"))
    ids = table.token_to_id("<pad>"), table.token_to_id("<unk>")
    side = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(side | {"pad_token": "<pad>",
                                                                     "unk_token": "<unk>"}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"pad_token_id": ids[0], "unk_token_id": ids[1]}))
    return folder, ids


def test_export_keeps_pad_and_unk_as_transformers_reads_them(tmp_path, capsys):
    (source, ids), out = _source(tmp_path / "source"), tmp_path / "out"
    assert main(["export", "--model", str(source), str(out)]) == 0
    read = {name: (transformers.AutoTokenizer.from_pretrained(folder),
                   transformers.AutoConfig.from_pretrained(folder))
            for name, folder in (("source", source), ("export", out))}
    for tokenizer, config in read.values():
        assert (tokenizer.pad_token, tokenizer.unk_token) == ("<pad>", "<unk>")
        assert (tokenizer.pad_token_id, tokenizer.unk_token_id) == ids
        assert (config.pad_token_id, config.unk_token_id) == ids
    (tok_a, config_a), (tok_b, config_b) = read.values()
    assert (config_a.bos_token_id, config_a.eos_token_id) == (config_b.bos_token_id, config_b.eos_token_id)
    assert tok_a("the lazy fox").input_ids == tok_b("the lazy fox").input_ids


def test_export_of_a_tokenizer_that_adds_bos_says_so_and_transformers_agrees(tmp_path):
    """A folder whose post-processor adds BOS (as Gemma's): the export writes add_bos_token true
    and adds it the same way, once."""
    from tokenizers import processors

    source, out = tmp_path / "source", tmp_path / "out"
    _source(source)
    table = Tokenizer.from_file(str(source / "tokenizer.json"))
    bos = table.token_to_id("<|endoftext|>")
    table.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B",
        special_tokens=[("<|endoftext|>", bos)])
    table.save(str(source / "tokenizer.json"))
    side = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps(side | {"bos_token": "<|endoftext|>"}))
    assert main(["export", "--model", str(source), str(out)]) == 0
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True
    ids = [transformers.AutoTokenizer.from_pretrained(f)("the lazy fox").input_ids for f in (source, out)]
    assert ids[0] == ids[1] and ids[1][0] == bos and ids[1].count(bos) == 1
