"""One option table: every flag that several commands take is the table's, with one type,
default and meaning in each; the engine's flags follow EngineConfig; `info --model` and
OpenAI's field names in `generate --prompts-file`."""

import argparse
import dataclasses
import json
from collections import defaultdict

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.accel import threads
from glassformer.cli import build_parser, main
from glassformer.cli import generate as generate_command
from glassformer.cli.options import ENGINE, FLAGS, engine_config
from glassformer.formats import checkpoint
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.serving import EngineConfig
from glassformer.serving.graph_path import FLEX_BLOCK

TOKENIZER = HFTokenizer.train_bpe(["the quick brown fox jumps over a lazy dog, the cat sat"] * 9, 300)
# Commands that compute (load weights and run them): each takes --device and --threads.
COMPUTING = ("train", "eval", "journey", "compare", "generate", "fill-mask", "chat", "serve")


def _commands() -> dict[str, argparse.ArgumentParser]:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(subparsers.choices)


def _options() -> dict[str, list[tuple[str, argparse.Action]]]:
    """option string -> [(command, action)] over every command's parser."""
    seen = defaultdict(list)
    for command, parser in _commands().items():
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    seen[option].append((command, action))
    return seen


def _meaning(action: argparse.Action) -> tuple:
    """What a flag is, beyond whether a command requires it and where it stores its value."""
    return (type(action).__name__, tuple(action.option_strings), action.type, action.default,
            tuple(action.choices) if action.choices is not None else None, action.nargs,
            action.const, action.metavar, action.help)


def test_every_flag_that_commands_share_is_the_tables_and_means_the_same_in_each():
    shared = {option: uses for option, uses in _options().items() if len(uses) > 1}
    assert "--model" in shared and "--device" in shared and "--kv-memory-mb" in shared
    for option, uses in shared.items():
        names = uses[0][1].option_strings  # --no-prefix-caching is --prefix-caching's
        flag = next((f for f in FLAGS.values() if set(f.names) & set(names)), None)
        assert flag is not None, f"{option}: taken by {[c for c, _ in uses]} but not in the table"
        meanings = {_meaning(action) for _, action in uses}
        assert len(meanings) == 1, f"{option} differs between {[c for c, _ in uses]}"
        action = uses[0][1]
        for setting, value in flag.settings.items():  # and it is the table's
            if setting == "action":
                assert type(action) is argparse.ArgumentParser()._registry_get("action", value, value)
            else:
                assert getattr(action, setting) == value, option


@pytest.mark.parametrize("command", COMPUTING)
def test_every_computing_command_takes_device_and_threads(command):
    options = {o for a in _commands()[command]._actions for o in a.option_strings}
    assert {"--device", "--threads"} <= options


def test_engine_flags_are_enginesconfig_fields_with_its_defaults_in_generate_and_serve():
    defaults = EngineConfig()
    for command in ("generate", "serve"):
        args = build_parser().parse_args([command, "--model", "m"])
        assert engine_config(args) == defaults
        args = build_parser().parse_args([command, "--model", "m", "--kv-memory-mb", "64", "--max-batch",
                                          "3", "--kv-dtype", "int8", "--no-prefix-caching"])
        assert engine_config(args) == dataclasses.replace(
            defaults, kv_memory_mb=64.0, max_batch=3, kv_dtype="int8", prefix_caching=False)
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert {flag[2:].replace("-", "_") for flag in ENGINE} <= names


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_compile_on_cuda_takes_kv_blocks_of_flex_attentions_size_unless_asked_otherwise(command, capsys):
    compiled = build_parser().parse_args([command, "--model", "m", "--compile"])
    assert engine_config(compiled, "cuda:0").block_size == FLEX_BLOCK
    assert f"KV blocks of {FLEX_BLOCK} tokens" in capsys.readouterr().err
    assert engine_config(compiled, "cpu").block_size == EngineConfig().block_size
    plain = build_parser().parse_args([command, "--model", "m"])
    assert engine_config(plain, "cuda").block_size == EngineConfig().block_size
    asked = build_parser().parse_args([command, "--model", "m", "--compile", "--block-size", "256"])
    assert engine_config(asked, "cuda").block_size == 256


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("bad", [["--kv-memory-mb", "0"], ["--kv-memory-mb", "nan"], ["--max-batch", "0"],
                                 ["--max-batch", "2.5"], ["--kv-dtype", "fp4"], ["--token-budget", "-1"]])
def test_engine_flags_are_refused_alike_at_parse_time(command, bad, capsys):
    assert main([command, "--model", "never-read", *bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and bad[0] in err[0]


def test_serve_names_its_request_cap_apart_from_evals_tokens_to_score(capsys):
    args = build_parser().parse_args(["serve", "--model", "m", "--max-request-tokens", "7"])
    assert args.max_request_tokens == 7
    assert main(["serve", "--model", "m", "--max-tokens", "7"]) == 2
    assert "--max-tokens" in capsys.readouterr().err


@pytest.fixture
def run(tmp_path):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny-llama").replace(vocab_size=TOKENIZER.vocab_size,
                                                         init_std=0.3)).eval()
    checkpoint.save_to_run(tmp_path / "run", 1, ("latest",), model, TOKENIZER, {"train": {"lr": 0.01}})
    return tmp_path / "run", model


def _requests(tmp_path, lines) -> str:
    path = tmp_path / f"prompts{len(list(tmp_path.iterdir()))}.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    return str(path)


def test_prompts_file_takes_openais_field_names_beside_its_own(run, tmp_path, capsys):
    folder, _ = run
    ours = [{"prompt": "the cat", "max_new_tokens": 5, "temperature": 0.8, "top_p": 0.9, "seed": 3,
             "stop": ["zz"]}, {"prompt": "a dog", "max_new_tokens": 2}]
    theirs = [{"prompt": "the cat", "max_tokens": 5, "temperature": 0.8, "top_p": 0.9, "seed": 3,
               "stop": "zz"}, {"prompt": "a dog", "max_completion_tokens": 2}]
    printed = []
    for lines in (ours, theirs):
        assert main(["generate", "--model", str(folder), "--prompts-file", _requests(tmp_path, lines),
                     "--ignore-eos"]) == 0
        printed.append([json.loads(line) for line in capsys.readouterr().out.splitlines()[:2]])
    assert [r["generated_ids"] for r in printed[0]] == [r["generated_ids"] for r in printed[1]]
    assert [len(r["generated_ids"]) for r in printed[1]] == [5, 2]
    both = _requests(tmp_path, [{"prompt": "ab", "max_tokens": 2, "max_new_tokens": 3}])
    assert main(["generate", "--model", str(folder), "--prompts-file", both]) == 2
    assert "max_new_tokens" in capsys.readouterr().err


def test_info_describes_a_checkpoint_folder_and_a_hugging_face_folder(run, tmp_path, capsys):
    folder, model = run
    assert main(["info", "--model", str(folder), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["config"] == model.config.to_dict()
    assert described["parameters"]["total"] == sum(p.numel() for p in model.parameters())
    assert described["file"]["format"] == "glassformer checkpoint"
    assert described["file"]["metadata"]["train.lr"] == 0.01
    tokenizer = described["tokenizer"]
    assert (tokenizer["vocab_size"], tokenizer["eos_id"]) == (TOKENIZER.vocab_size, TOKENIZER.eos_id)
    assert not tokenizer["chat_template"]
    assert main(["export", "--model", str(folder), "-o", str(tmp_path / "hf")]) == 0
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    capsys.readouterr()
    assert main(["info", "--model", str(tmp_path / "hf")]) == 0
    text = capsys.readouterr().out
    assert "huggingface" in text and f"{sum(p.numel() for p in model.parameters()):,}" in text
    assert all(f"{key:>40}  {value}" in text for key, value in hf_config.items() if isinstance(value, int))


def test_info_refuses_two_sources_and_none(capsys):
    assert main(["info", "--model", "m", "--preset", "gpt2"]) == 2
    assert main(["info"]) == 2


@pytest.mark.slow
def test_info_prints_a_gguf_files_metadata(smollm2_path, capsys):
    from gguf import GGUFReader

    reader = GGUFReader(str(smollm2_path))
    assert main(["info", "--model", str(smollm2_path), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    file = described["file"]
    assert file["format"] == "gguf" and sum(file["tensor_types"].values()) == len(reader.tensors)
    assert file["metadata"]["general.architecture"] == "llama"
    assert file["metadata"]["llama.block_count"] == described["config"]["n_layers"]
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert file["metadata"]["tokenizer.ggml.tokens"] == f"[{len(tokens.data)} items]"
    tokenizer = described["tokenizer"]
    assert tokenizer["vocab_size"] == len(tokens.data) and tokenizer["chat_template"]


def test_a_command_settles_its_threads_once_its_model_is_loaded(run, monkeypatch, capsys):
    """The thread policy's window runs while the model loads: main() makes the policy, the
    command loads, then settles it, then computes."""
    folder, _ = run
    events = []

    class Policy:
        def __init__(self, asked):
            events.append("made")

        def settle(self):
            events.append("settled")
            return torch.get_num_threads()

    def load(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        events.append("loaded")
        return loaded

    real_load = generate_command.load
    monkeypatch.setattr(threads, "ThreadPolicy", Policy)
    monkeypatch.setattr(generate_command, "load", load)
    assert main(["generate", "--model", str(folder), "the cat", "-n", "2", "--json"]) == 0
    assert events == ["made", "loaded", "settled"]
    assert json.loads(capsys.readouterr().out)["generated_ids"]


@pytest.mark.parametrize("command", ["generate", "serve", "chat"])
def test_deterministic_is_one_flag_that_reaches_the_engine(command):
    args = build_parser().parse_args([command, "--model", "m", "--deterministic"])
    assert args.deterministic
    if command != "chat":
        assert engine_config(args) == dataclasses.replace(EngineConfig(), deterministic=True)
    assert not build_parser().parse_args([command, "--model", "m"]).deterministic


def test_deterministic_on_the_cpu_gives_the_same_tokens(run, tmp_path, capsys):
    folder, _ = run
    lines = [{"prompt": "the cat", "max_tokens": 5}, {"prompt": "a lazy dog sat", "max_tokens": 3,
                                                       "temperature": 0.9, "seed": 2}]
    prompts_file = _requests(tmp_path, lines)
    printed = []
    for extra in ([], ["--deterministic"]):
        assert main(["generate", "--model", str(folder), "the cat", "-n", "5", "--json", *extra]) == 0
        single = json.loads(capsys.readouterr().out)["generated_ids"]
        assert main(["generate", "--model", str(folder), "--prompts-file", prompts_file, *extra]) == 0
        many = [json.loads(line)["generated_ids"] for line in capsys.readouterr().out.splitlines()[:2]]
        printed.append((single, many))
    assert printed[0] == printed[1]


def test_a_cuda_device_gets_bf16_weights_and_the_choice_named(monkeypatch, capsys):
    """The decision for a CUDA device, asked on the CPU: the device as pick_device gives it."""
    from glassformer.cli import options
    from glassformer.training import distributed

    applied = []
    monkeypatch.setattr(distributed, "pick_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(options, "use_precision", applied.append)
    args = build_parser().parse_args(["generate", "--model", "m", "x", "--device", "cpu"])
    device, precision = options.inference_precision(args)
    assert device == "cuda:0" and precision.dtype == torch.bfloat16 and precision.quantize is None
    assert applied == [precision]
    assert capsys.readouterr().err.strip() == "glassformer: cuda: bfloat16 weights, TF32 float32 products"
