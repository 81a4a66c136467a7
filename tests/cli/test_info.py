"""`glassformer info` names a model's family (from its file, or the one export writes it as)
and its pieces."""

from __future__ import annotations

import json

import pytest
from llama_folder import llama_folder

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
    assert f"family  {family.name} (model_type {model_type}, GGUF {family.gguf})" in text
    for name, values in pieces(config):
        assert f"  {name}: {values}\n" in text if values else f"  {name}\n" in text
