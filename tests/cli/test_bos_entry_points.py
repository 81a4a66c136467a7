"""A Hugging Face folder whose tokenizer.json adds BOS (as Gemma's and Llama 3's do) starts
every prompt with it, exactly once, on every entry point: generate, the engine, chat, lens."""

from __future__ import annotations

import json

import pytest
from llama_folder import llama_folder
from tokenizers import Tokenizer, processors

from glassformer import load
from glassformer.cli import main

BOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("bos") / "hf"
    llama_folder(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)])
    tokenizer.save(str(folder / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": BOS, "chat_template": template}))
    return folder


def _starts_once(ids: list[int], bos: int) -> bool:
    return ids[0] == bos and ids.count(bos) == 1


def test_generate_the_engine_and_chat_start_with_bos_once(folder, capsys):
    language_model = load(folder, progress=False)
    bos = language_model.tokenizer.bos_id
    assert main(["generate", "--model", str(folder), "-n", "2", "--json", "The capital of"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert _starts_once(shown["prompt_ids"], bos)
    [result] = language_model.generate_many(["The capital of"], max_new_tokens=2)
    assert _starts_once(result.prompt_ids, bos) and result.prompt_ids == shown["prompt_ids"]
    chat = language_model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert _starts_once(chat, bos)


def test_lens_reads_the_prompt_with_bos(folder, capsys):
    assert main(["lens", "--model", str(folder), "--json", "The capital of"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["tokens"][0] == BOS
