"""`glassformer info` names a model's family (from its file, or the one export writes it as)
and its pieces."""

from __future__ import annotations

import json

import pytest
from llama_folder import chat_llama_folder, llama_folder

from glassformer.cli import main
from glassformer.formats.families import BY_MODEL_TYPE
from glassformer.model.pieces import pieces


def _info(capsys, *args) -> dict:
    assert main(["info", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_preset_is_named_by_the_family_export_writes(capsys):
    shown = _info(capsys, "--preset", "tiny-llama")
    assert shown["family"] == {"name": "Llama", "model_type": "llama", "gguf": "llama", "from": "export"}
    names = [piece["name"] for piece in shown["pieces"]]
    assert names == ["RoPE", "RMSNorm", "GQA", "SwiGLU", "tied head"]
    assert shown["pieces"][2]["values"] == "4 heads, 2 key/value heads"
    assert _info(capsys, "--preset", "tiny-alibi")["family"] is None  # no family has ALiBi
    assert main(["info", "--preset", "tiny-alibi"]) == 0
    assert "none of the supported families" in capsys.readouterr().out


def test_a_folder_and_a_gguf_file_are_named_by_what_they_say(tmp_path, capsys):
    pytest.importorskip("transformers")
    folder = tmp_path / "hf"
    llama_folder(folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(hf | {"model_type": "mistral"}))
    assert _info(capsys, "--model", str(folder))["family"]["name"] == "Mistral"  # its own word
    gguf = tmp_path / "m.gguf"
    assert main(["export", "--model", str(folder), "--to", "gguf", str(gguf)]) == 0
    capsys.readouterr()
    assert _info(capsys, "--model", str(gguf))["family"] == {
        "name": "Llama", "model_type": "llama", "gguf": "llama", "from": "general.architecture"}


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_neox", "olmo2"])
def test_the_text_names_the_family_and_each_piece(model_type, tmp_path, capsys):
    family = BY_MODEL_TYPE[model_type]
    config = family.read(family.example)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model": config.to_dict()}))
    assert main(["info", "--config", str(path)]) == 0
    text = capsys.readouterr().out
    assert f"family  {family.name} (model_type {model_type}, GGUF {family.gguf.name})" in text
    for name, values in pieces(config):
        assert f"  {name}: {values}\n" in text if values else f"  {name}\n" in text


def test_a_gguf_file_shows_its_tokenizer_and_what_each_path_does_with_its_tensors(tmp_path, capsys):
    """From the header alone: the tokenizer's kind, pre-tokenizer, BOS rule and end ids; each
    tensor in the JSON, and per type in the text (kept in its blocks or float32, and why)."""
    pytest.importorskip("transformers")
    from glassformer.formats.gguf_file import GGUFFile

    folder, gguf = tmp_path / "hf", tmp_path / "m.gguf"
    chat_llama_folder(folder, "{{ messages[0]['content'] }}")
    assert main(["export", "--model", str(folder), "--to", "gguf", "--dtype", "q8_0", str(gguf)]) == 0
    capsys.readouterr()
    shown = _info(capsys, "--model", str(gguf))
    with GGUFFile(gguf) as file:
        pre, stored = file.metadata["tokenizer.ggml.pre"], file.tensors
        eos = file.metadata["tokenizer.ggml.eos_token_id"]
    tokenizer = shown["tokenizer"]
    assert (tokenizer["kind"], tokenizer["pre_tokenizer"], tokenizer["add_bos"]) == (
        "gpt2 (byte-level BPE)", pre, False)
    assert (tokenizer["bos_rule"], tokenizer["end_ids"], tokenizer["end_tokens"]) == (
        "no BOS before a text", [eos], ["<|endoftext|>"])
    tensors = {t["name"]: t for t in shown["file"]["tensors"]}
    assert set(tensors) == set(stored)
    matrices = {name for name, info in stored.items() if len(info.shape) == 2}
    assert {tensors[name]["type"] for name in matrices} == {"Q8_0"}
    assert all(tensors[name]["quantize_gguf"] == "blocks" for name in matrices)
    assert all(t["quantize_gguf"] == "float32" for name, t in tensors.items() if name not in matrices)
    groups = shown["file"]["tensor_groups"]
    assert sum(g["tensors"] for g in groups) == len(stored)
    assert sum(g["bytes"] for g in groups) == sum(info.n_bytes for info in stored.values())
    assert main(["info", "--model", str(gguf)]) == 0
    text = capsys.readouterr().out
    assert f"Q8_0  {len(matrices) - 1} tensors, " in text  # the token table: a line of its own
    for group in groups:
        count = f"{group['tensors']} tensor{'s' if group['tensors'] > 1 else ''}"
        assert f"{group['type']:>24}  {count}, " in text and group["why"] in text
    assert "F32  " in text and "blk.0.attn_q.weight" not in text  # per type, not per tensor
    assert "bos_rule  no BOS before a text" in text and "kind  gpt2 (byte-level BPE)" in text
