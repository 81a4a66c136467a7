"""PEFT adapter files: written and read back with PEFT's key names; what PEFT can express but
Glassformer cannot, and damaged files, are one error naming the file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from glassformer.formats.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter, write_adapter


@pytest.fixture()
def adapter(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {(0, "q"): (torch.randn(2, 8, generator=g), torch.randn(8, 2, generator=g)),
               (1, "down"): (torch.randn(2, 16, generator=g), torch.randn(8, 2, generator=g))}
    write_adapter(tmp_path, tensors, 2, 4.0, 0.05, ("q", "down"), "my-base")
    return tmp_path, tensors


def test_round_trip_with_peft_names(adapter):
    folder, tensors = adapter
    keys = set(load_file(str(folder / ADAPTER_WEIGHTS)))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == ["down_proj", "q_proj"] and config["peft_type"] == "LORA"
    settings, read = read_adapter(folder)
    assert settings == {"rank": 2, "alpha": 4.0, "dropout": 0.05, "targets": ("q", "down"),
                        "base": "my-base"}
    assert read.keys() == tensors.keys()
    for key, (a, b) in tensors.items():
        assert torch.equal(read[key][0], a) and torch.equal(read[key][1], b)


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"peft_type": "IA3"}, "not a LoRA adapter"),
    ({"target_modules": ["c_attn"]}, "target_modules"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_unsupported_settings(adapter, change, message):
    folder, _ = adapter
    path = folder / ADAPTER_CONFIG
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    with pytest.raises(ValueError, match=f"^{path}: .*{message}"):
        read_adapter(folder)


def test_damaged_weights(adapter):
    folder, _ = adapter
    path = folder / ADAPTER_WEIGHTS
    files = load_file(str(path))
    del files["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    save_file(files, str(path))
    with pytest.raises(ValueError, match="layer 0 q lacks lora_A or lora_B"):
        read_adapter(folder)
    save_file(files | {"base_model.model.lm_head.weight": torch.zeros(1)}, str(path))
    with pytest.raises(ValueError, match="unexpected tensor base_model.model.lm_head.weight"):
        read_adapter(folder)
    path.write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        read_adapter(folder)
    path.unlink()
    with pytest.raises(FileNotFoundError, match="expected adapter_model.safetensors"):
        read_adapter(folder)
