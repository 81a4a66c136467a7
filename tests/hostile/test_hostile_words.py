"""Every refusal in the user's own words: the config.json key and file they wrote (our name
beside it), the flags they gave, the line of their prompts file, what an HTTP client sent."""

from __future__ import annotations

import json
import shutil

import pytest
from hostile_helpers import LLAMA, checkpoint_folder, hf_folder
from pydantic import ValidationError

from glassformer.serving.api.errors import from_validation
from glassformer.serving.api.protocol import CompletionRequest
from glassformer.training.lora import LoRAConfig, check_targets


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("hf") / "llama")


@pytest.mark.parametrize("change, named", [
    ({"rms_norm_eps": -1.0}, "rms_norm_eps: must be positive"),
    ({"head_dim": 7}, "head_dim: RoPE needs an even head size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads: "),
    ({"num_attention_heads": 0}, "num_attention_heads: "),
    ({"hidden_size": "64"}, "hidden_size: expected int, got '64'"),
    ({"max_position_embeddings": 0}, "max_position_embeddings: "),
])
def test_config_json_errors_name_the_key_and_the_file(change, named, hf_model, tmp_path, refused):
    folder = tmp_path / "model"
    shutil.copytree(hf_model, folder)
    config = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    line = refused(["generate", "--model", folder, "-n", "1", "hi"], named, folder, seconds=10)
    ours = {"rms_norm_eps": "norm_eps", "head_dim": "d_head", "num_key_value_heads": "n_kv_heads",
            "num_attention_heads": "n_heads", "hidden_size": "d_model",
            "max_position_embeddings": "context_length"}[next(iter(change))]
    assert line.endswith(f"(our {ours}, in {folder / 'config.json'})")


def test_a_folder_without_model_type_says_so(hf_model, tmp_path, refused):
    folder = tmp_path / "model"
    shutil.copytree(hf_model, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["model_type"]
    (folder / "config.json").write_text(json.dumps(config))
    refused(["generate", "--model", folder, "hi"], 'has no "model_type"', folder, seconds=10)


@pytest.mark.parametrize("flags, named", [
    (["--port", "-5"], "--port"), (["--port", "70000"], "--port"),
    (["--host", "no.such.host.invalid"], "--host"), (["--host", "203.0.113.7"], "--host"),
])
def test_serve_checks_the_address_before_loading_the_model(flags, named, tmp_path, refused):
    """The model does not exist: the address is refused before anything reads it."""
    refused(["serve", "--model", tmp_path / "absent", *flags], named, tmp_path, seconds=5)


def test_a_prompts_file_line_asking_past_the_window_is_refused_by_its_own_name(tmp_path, refused):
    model = checkpoint_folder(tmp_path / "model")  # a 32-token window
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n\n{"prompt": "hello", "max_tokens": 100000}\n')
    line = refused(["generate", "--model", model, "--prompts-file", prompts], f"{prompts}:3: max_tokens: ",
                   tmp_path, seconds=10)
    assert "100000 new tokens after the prompt's 5" in line and "give at most 27" in line


def test_an_adapter_rank_too_large_is_told_without_a_command_line_flag():
    """The same check answers an HTTP client loading an adapter: no CLI flag in it."""
    with pytest.raises(ValueError) as refusal:
        check_targets(LLAMA, LoRAConfig(rank=2000, alpha=16.0, targets=("q", "k")))
    assert "2000 is above 16" in str(refusal.value) and "--" not in str(refusal.value)


def test_a_lone_surrogate_is_named_as_such():
    body = b'{"model": "m", "prompt": "\\ud800 hi"}'  # valid JSON text
    with pytest.raises(ValidationError) as refusal:
        CompletionRequest.model_validate_json(body)
    error = from_validation(refusal.value)
    assert error.status == 400 and "unpaired surrogate" in error.message
    with pytest.raises(ValidationError) as broken:
        CompletionRequest.model_validate_json(b'{"model": "m", "prompt": ')
    assert "not valid JSON" in from_validation(broken.value).message


def test_a_prompts_file_line_larger_than_the_pool_names_its_line_and_max_tokens(tmp_path, refused):
    """Within the window but past a pool of 2 blocks of 4 tokens: the line and the field the
    request could change (its prompt fits)."""
    model = checkpoint_folder(tmp_path / "model")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "max_tokens": 2}\n{"prompt": "hello", "max_tokens": 20}\n')
    block = 2 * 1 * 4 * 2 * 8 * 4 / 2**20  # MiB: keys and values, 1 layer, 4 tokens, 2 heads of 8
    line = refused(["generate", "--model", model, "--prompts-file", prompts, "--block-size", "4",
                    "--kv-memory-mb", str(2 * block)], f"{prompts}:2: max_new_tokens: the request needs 28",
                   tmp_path, seconds=10)
    assert "5 prompt + 20 new" in line and "the engine holds 8" in line
