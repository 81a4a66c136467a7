"""The Python API given hostile values: clear exceptions naming the argument, never a crash
deep inside, never a silent wrong answer."""

from __future__ import annotations

import math
import os

import pytest
import safetensors.torch
import torch
from hostile_helpers import LLAMA, TEMPLATE, checkpoint_folder

import glassformer
from glassformer.formats.chat_tokenizer import render_template
from glassformer.formats.checkpoint import Checkpoint, save_to_run
from glassformer.formats.files import check_output, read_json_object
from glassformer.formats.tokenizers import CharTokenizer
from glassformer.home import home
from glassformer.model.config import ModelConfig
from glassformer.training.config import TrainConfig, resume_conflicts

STORED = {torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL"}  # safetensors' names


@pytest.fixture(scope="module")
def lm(gguf_file):
    return glassformer.load(gguf_file)


@pytest.mark.parametrize("prompt", [12345, 3.5, None, {"a": 1}])
def test_a_prompt_that_is_neither_text_nor_ids(prompt, lm):
    with pytest.raises(TypeError, match="prompt: give a str or a sequence of token ids"):
        lm.generate(prompt)


@pytest.mark.parametrize("ids", [[-1], [128], [10 ** 9], [1, 2.0], [True], ["a"], [1, None]])
@pytest.mark.parametrize("method", ["generate", "logits", "trace"])
def test_token_ids_outside_the_vocabulary(ids, method, lm):
    with pytest.raises(ValueError, match="token id .* is not in the vocabulary \\(0 to 127\\)"):
        getattr(lm, method)(ids)


def test_ids_as_a_tensor_or_tuple_work(lm):
    a = lm.generate(torch.tensor([1, 2, 3]), max_new_tokens=2).generated_ids
    assert a == lm.generate((1, 2, 3), max_new_tokens=2).generated_ids


@pytest.mark.parametrize("field, value", [
    ("rope_theta", math.nan), ("norm_eps", math.inf), ("dropout", math.nan), ("init_std", -math.inf),
    ("rope_factor", math.nan), ("d_model", "32"), ("n_layers", 2.0), ("tie_embeddings", "yes"),
    ("n_heads", True), ("d_ff", -1),
])
def test_model_config_refuses_values_that_pass_a_sign_check(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        LLAMA.replace(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("lr", math.inf), ("lr", math.nan), ("min_lr", math.nan), ("weight_decay", math.inf),
    ("grad_clip", math.nan), ("max_time", math.inf), ("beta2", math.nan), ("batch_size", 2.5),
    ("device", 0), ("compile", 1),
])
def test_train_config_refuses_non_finite_and_mistyped_values(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        TrainConfig(**{field: value})


@pytest.mark.parametrize("values, message", [
    ([1, 2], "expected an object of fields"), ({"d_model": 8}, "vocab_size: a required"),
    ({**LLAMA.to_dict(), "flux": 1}, "flux: not a ModelConfig field"),
])
def test_config_from_dict(values, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(values)


def test_resume_follows_a_new_budget_unless_the_decay_was_set():
    saved = TrainConfig(max_iters=30)
    assert resume_conflicts(saved, saved.replace(max_iters=60)) == []
    pinned = saved.replace(lr_decay_iters=30)
    assert resume_conflicts(pinned, saved.replace(max_iters=60)) == [
        "lr_decay_iters=60 (saved 30)"]
    assert resume_conflicts(pinned, pinned.replace(max_iters=60)) == []


@pytest.mark.parametrize("source, error, message", [
    ("/dev/zero", ValueError, "not a regular file"), ("/nonexistent/model", FileNotFoundError, "no model"),
    ("smollm2-135m-instruct-typo", FileNotFoundError, "known name"),
])
def test_load_refuses_what_is_not_a_model(source, error, message):
    with pytest.raises(error, match=message):
        glassformer.load(source)


def test_load_refuses_an_unknown_quantization(gguf_file):
    with pytest.raises(ValueError, match="quantize"):
        glassformer.load(gguf_file, quantize="int3")


@pytest.mark.parametrize("template, message", [
    ("{% if %}", "syntax error on line 1"), ("{{ ''.__class__.__mro__ }}", "unsafe"),
    ("{{ x() }}", "UndefinedError"), ("{{ 'a' * 10**7 }}", "output over"),
    ("{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}", "took over"),
])
def test_render_template_errors_are_value_errors(template, message):
    with pytest.raises(ValueError, match=f"^chat template: .*{message}"):
        render_template(template, 1000, messages=[])


def test_render_template_renders_a_real_template():
    text = render_template(TEMPLATE, 1000, messages=[{"role": "user", "content": "hi"}],
                           add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_check_output(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    os.symlink(model, tmp_path / "alias.gguf")
    with pytest.raises(ValueError, match="replace the input"):
        check_output(tmp_path / "alias.gguf", [model], force=True)
    with pytest.raises(ValueError, match="inside the input"):
        check_output(tmp_path / "new.html", [tmp_path], force=True)
    with pytest.raises(ValueError, match="--force"):
        check_output(model, [])
    assert check_output(tmp_path / "fresh.html", [model]) == tmp_path / "fresh.html"


@pytest.mark.parametrize("content, message", [
    (b"", "not valid JSON"), (b"null", "expected a JSON object, found a NoneType"),
    (b'"x"', "expected a JSON object, found a str"),
    (b"\x80", "not valid UTF-8"),
])
def test_read_json_object(content, message, tmp_path):
    path = tmp_path / "f.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"f.json: {message}"):
        read_json_object(path)


def test_save_prunes_only_what_its_links_pointed_to(tmp_path):
    model = torch.nn.Linear(2, 2)
    model.config = ModelConfig(vocab_size=4, context_length=4, d_model=4, n_layers=1, n_heads=1)
    tokenizer = CharTokenizer("abc")
    save_to_run(tmp_path, 1, ("latest", "best"), model, tokenizer, {})
    (tmp_path / "latest").unlink()  # a copy that dropped the link
    save_to_run(tmp_path, 2, ("latest",), model, tokenizer, {})
    save_to_run(tmp_path, 3, ("latest", "best"), model, tokenizer, {})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0000003"]
    save_to_run(tmp_path, 4, ("latest",), model, tokenizer, {})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-0000003", "step-0000004"]


def test_checkpoint_open_names_the_broken_file(tmp_path):
    folder = checkpoint_folder(tmp_path / "c")
    (folder / "config.json").write_text('{"model": {"d_model": "x"}}', encoding="utf-8")
    with pytest.raises(ValueError, match="config.json: .*"):
        Checkpoint.open(folder)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_a_checkpoint_weight_stored_as_integers_is_refused(dtype, tmp_path):
    folder = checkpoint_folder(tmp_path / "c")
    weights = safetensors.torch.load_file(folder / "model.safetensors")
    weights["final_norm.weight"] = weights["final_norm.weight"].to(dtype)
    safetensors.torch.save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match=f"tensor final_norm.weight is stored as {STORED[dtype]}, not a "
                                         "floating-point type; the model holds it as torch.float32"):
        glassformer.load(folder)


def test_a_checkpoint_in_half_precision_still_loads(tmp_path):
    folder = checkpoint_folder(tmp_path / "c")
    weights = safetensors.torch.load_file(folder / "model.safetensors")
    safetensors.torch.save_file({k: v.half() for k, v in weights.items()}, folder / "model.safetensors")
    loaded = glassformer.load(folder).model.state_dict()
    for name, value in weights.items():
        torch.testing.assert_close(loaded[name], value.half().float())


@pytest.mark.parametrize("variable", ["GLASSFORMER_HOME", "XDG_CACHE_HOME"])
def test_a_home_variable_naming_a_file_is_refused_by_name(variable, tmp_path, monkeypatch):
    path = tmp_path / "file"
    path.write_text("x", encoding="utf-8")
    monkeypatch.delenv("GLASSFORMER_HOME", raising=False)
    monkeypatch.setenv(variable, str(path))
    with pytest.raises(NotADirectoryError, match=f"^{variable}: {path} is not a folder"):
        home()
