"""Every command's bad values: refused at once with one line, never ignored, inverted or
turned into a traceback; prompts from files and standard input."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hostile_helpers import checkpoint_folder

from glassformer.cli import main

M = "MODEL"  # replaced by a checkpoint folder (parse-time refusals never read it)

BAD = {
    "generate": [
        (["--temperature", "nan"], "--temperature"), (["--temperature", "inf"], "--temperature"),
        (["--temperature", "-1"], "--temperature"), (["--temperature", "hot"], "not a number"),
        (["-n", "0"], "--max-new-tokens"), (["-n", "-3"], "--max-new-tokens"),
        (["-n", "many"], "not an integer"), (["--top-k", "0"], "--top-k"),
        (["--top-p", "nan"], "--top-p"), (["--top-p", "0"], "--top-p"), (["--top-p", "1.5"], "--top-p"),
        (["--min-p", "inf"], "--min-p"), (["--min-p", "2"], "--min-p"),
        (["--repetition-penalty", "nan"], "--repetition-penalty"),
        (["--repetition-penalty", "0"], "--repetition-penalty"),
        (["--presence-penalty", "inf"], "--presence-penalty"),
        (["--frequency-penalty", "nan"], "--frequency-penalty"),
        (["--beams", "0"], "--beams"), (["--length-penalty", "nan"], "--length-penalty"),
        (["--rope-factor", "inf"], "--rope-factor"),
        (["--device", "bogus"], "bogus"), (["--device", "cuda:7"], "cuda"),
        (["--device", ""], "device"), (["--quantize", "int3"], "--quantize"),
        (["--rope-scaling", "sideways"], "--rope-scaling"),
    ],
    "eval": [
        (["--max-tokens", "-5"], "--max-tokens"), (["--max-tokens", "0"], "--max-tokens"),
        (["--batch-size", "0"], "--batch-size"), (["--batch-size", "-2"], "--batch-size"),
        (["--device", "bogus"], "bogus"), (["--device", "cuda"], "CUDA"),
        (["--documents", "pages"], "--documents"),
    ],
    "compare": [
        (["--atol", "-1"], "--atol"), (["--rtol", "-1"], "--rtol"), (["--atol", "nan"], "--atol"),
        (["--rtol", "inf"], "--rtol"), (["--reference", "llama.cpp"], "--reference"),
    ],
    "chat": [
        (["--max-context", "-1"], "--max-context"), (["--max-context", "0"], "--max-context"),
        (["--temperature", "nan"], "--temperature"), (["--top-k", "0"], "--top-k"),
        (["-n", "0"], "--max-new-tokens"), (["--top-p", "inf"], "--top-p"),
        (["--repetition-penalty", "nan"], "--repetition-penalty"),
    ],
    "journey": [
        (["--top-k", "0"], "--top-k"), (["--ig-steps", "0"], "--ig-steps"),
        (["--device", "bogus"], "bogus"), (["--top-k", "-4"], "--top-k"),
    ],
    "export": [(["--format", "onnx"], "--format")],
    "fill-mask": [(["--top-k", "0"], "--top-k"), (["--top-k", "many"], "not an integer"),
                  (["--device", "bogus"], "bogus")],
    "experiment": [
        (["--budget", "nan"], "--budget"), (["--budget", "-1"], "--budget"),
        (["--budget", "0"], "--budget"), (["--budget", "inf"], "--budget"),
        (["--threads", "0"], "--threads"), (["--equal", "vibes"], "--equal"),
    ],
}
PROMPTED = {"generate", "compare", "journey", "fill-mask"}


def _argv(command, extra, model):
    if command == "experiment":
        return [command, "cache", "--out", str(model.parent / "exp"), *extra]
    argv = [command, "--model", model, *extra]
    if command in PROMPTED:
        argv.append("hi")
    if command == "eval":
        argv += ["--data", str(model / "config.json")]
    if command == "export":
        argv += ["-o", str(model.parent / "out")]
    return argv


CASES = [(command, extra, message) for command, cases in BAD.items() for extra, message in cases]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return checkpoint_folder(tmp_path_factory.mktemp("cli") / "ckpt")


@pytest.mark.parametrize("command, extra, message", CASES,
                         ids=[f"{c} {' '.join(e)}" for c, e, _ in CASES])
def test_bad_values_are_refused(command, extra, message, model, refused):
    refused(_argv(command, extra, model), message, model, seconds=10)


GLOBAL = [
    ([], "required"), (["frobnicate"], "invalid choice"), (["generate"], "--model"),
    (["info"], "one of the arguments"), (["info", "--preset", "gpt-17"], "gpt-17"),
    (["pull"], "name"), (["generate", "--model", "x", "a", "b"], "unrecognized"),
    (["train", "--data", "x"], "--out"), (["eval", "--model", "x"], "--data"),
]


@pytest.mark.parametrize("argv, message", GLOBAL, ids=[" ".join(a) or "nothing" for a, _ in GLOBAL])
def test_bad_command_lines_are_one_line(argv, message, tmp_path, refused):
    refused(argv, message, tmp_path)


@pytest.mark.parametrize("content, message", [
    (b"[1, 2]", "expected a JSON object"), (b"{", "not valid JSON"), (b"\xff\xfe", "UTF-8"),
    (b'{"d_model": 16}', "required ModelConfig field"), (b'{"model": []}', "ModelConfig"),
])
def test_info_config_files(content, message, tmp_path, refused):
    path = tmp_path / "c.json"
    path.write_bytes(content)
    refused(["info", "--config", path], message, path)


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("glassformer ")


def test_help_exits_zero(capsys):
    assert main(["generate", "--help"]) == 0
    assert "--prompt-file" in capsys.readouterr().out


BAD_UTF8 = os.fsdecode(b"caf\xe9")  # how Python hands over an argument that is not UTF-8


@pytest.mark.parametrize("command", ["generate", "compare", "journey"])
def test_a_prompt_that_is_not_utf8(command, model, refused):
    refused([command, "--model", model, BAD_UTF8], "not valid UTF-8", model)


@pytest.mark.parametrize("command", ["generate", "compare", "journey"])
def test_prompt_file_problems(command, model, tmp_path, refused):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 au lait")
    refused([command, "--model", model, "--prompt-file", bad], "bad.txt: not valid UTF-8", bad)
    refused([command, "--model", model, "--prompt-file", tmp_path / "none.txt"], "none.txt", tmp_path)
    refused([command, "--model", model, "--prompt-file", bad, "hi"], "not both", bad)
    refused([command, "--model", model], "no prompt", model)
    refused([command, "--model", model, "--prompt-file", tmp_path], "not a regular file", tmp_path)


def test_a_prompt_longer_than_an_argument_can_be(model, tmp_path, capsys):
    prompt = tmp_path / "long.txt"
    prompt.write_text("ab " * 100_000, encoding="utf-8")  # 300 KB: more than argv allows
    code = main(["generate", "--model", str(model), "--prompt-file", str(prompt), "-n", "1",
                 "--json", "--truncate"])
    assert code == 0
    assert len(json.loads(capsys.readouterr().out)["prompt_ids"]) == 31  # room for 1 new token


def test_prompt_from_standard_input(model, monkeypatch, capsys):
    class Stdin:
        buffer = io.BytesIO(b"hello")

    monkeypatch.setattr(sys, "stdin", Stdin())
    assert main(["generate", "--model", str(model), "-", "-n", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_ids"] != []


def test_prompt_from_standard_input_not_utf8(model, monkeypatch, refused):
    class Stdin:
        buffer = io.BytesIO(b"\xff\xff")

    monkeypatch.setattr(sys, "stdin", Stdin())
    refused(["generate", "--model", model, "-"], "standard input: not valid UTF-8", model)


def test_compare_atol_zero_is_accepted_but_negative_never_inverts(model, refused):
    refused(["compare", "--model", model, "--atol", "-0.5", "hi"], "must be >= 0", model)


def _run(argv, stdin: bytes, env_home: Path):
    env = dict(os.environ, GLASSFORMER_HOME=str(env_home), PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-m", "glassformer", *argv], input=stdin,
                          capture_output=True, timeout=240, env=env)


def test_chat_survives_a_line_that_is_not_utf8(gguf_file, monkeypatch, capsys):
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9\nhello\n/exit\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(["chat", "--model", str(gguf_file), "-n", "2"]) == 0
    out, err = capsys.readouterr()
    assert "not valid UTF-8" in err and "Traceback" not in err
    assert len(out.strip().splitlines()) == 1  # the second line was answered


def test_a_subprocess_error_is_one_line_with_status_2(tmp_path):
    done = _run(["generate", "--model", "/dev/zero", "hi"], b"", tmp_path)
    assert done.returncode == 2
    assert done.stderr.decode().strip().splitlines() == [
        "glassformer: error: /dev/zero: not a regular file or folder (a device or a pipe?)"]


def test_data_that_is_not_utf8_names_the_file(tmp_path, refused):
    data = tmp_path / "data"
    data.mkdir()
    (data / "good.txt").write_text("abc " * 200, encoding="utf-8")
    (data / "latin1.txt").write_bytes("café au lait ".encode("latin-1") * 50)
    for documents in ("file", "line"):
        refused(["train", "--data", data, "--out", tmp_path / "run", "--documents", documents,
                 "--no-progress"], "latin1.txt: not valid UTF-8", data)
        assert not (tmp_path / "run").exists()


def test_data_files_skipped_in_a_folder_are_listed_in_one_line(tmp_path, capsys):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("hello there " * 300, encoding="utf-8")
    (data / "a.bin").write_bytes(b"\x00\x01")
    (data / "sub" / "notes.md").write_text("# notes", encoding="utf-8")
    ckpt = checkpoint_folder(tmp_path / "ckpt")
    assert main(["eval", "--model", str(ckpt), "--data", str(data), "--json"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "skipped" in line]
    assert warnings == [f"glassformer: warning: {data}: skipped 2 file(s) not named *.txt: "
                        f"a.bin, {Path('sub', 'notes.md')}"]


def test_glassformer_home_that_is_a_file_names_the_variable(tmp_path, monkeypatch, refused):
    home = tmp_path / "home"
    home.write_text("a file, not a folder", encoding="utf-8")
    monkeypatch.setenv("GLASSFORMER_HOME", str(home))
    refused(["pull", "smollm2-135m-instruct"], f"GLASSFORMER_HOME: {home} is not a folder", home)


@pytest.mark.parametrize("line, message", [
    ('{"prompt": [1, 96]}', "prompt: token id 96 is not in the vocabulary (0 to 95)"),
    ('{"prompt": [-1]}', "prompt: token id -1"), ('{"prompt": [1.5]}', "prompt: token id 1.5"),
    ('{"prompt": 7}', "prompt: give a str"),
])
def test_prompts_file_ids_outside_the_vocabulary_name_the_line(line, message, model, tmp_path, refused):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n\n' + line + "\n", encoding="utf-8")
    refused(["generate", "--model", model, "--prompts-file", prompts, "-n", "1"],
            f"{prompts}:3: {message}", prompts, model)


def test_a_prompts_file_that_is_not_utf8_is_named(model, tmp_path, refused):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "hi"}\n{"prompt": "caf\xe9"}\n')
    refused(["generate", "--model", model, "--prompts-file", prompts, "-n", "1"],
            f"{prompts}: not valid UTF-8", prompts, model)


def test_journey_refuses_a_prompt_over_its_limit(model, tmp_path, refused):
    out = tmp_path / "j.html"
    refused(["journey", "--model", model, "-o", out, "--max-tokens", "8", "abcdefghi"],
            "text: 9 tokens, over the journey's limit of 8", model, seconds=10)
    assert not out.exists()


def test_journey_shows_its_progress(model, tmp_path, capsys):
    out = tmp_path / "j.html"
    assert main(["journey", "--model", str(model), "-o", str(out), "--max-tokens", "8", "abcdefgh",
                 "--ig-steps", "1"]) == 0
    stages = capsys.readouterr().err.splitlines()
    assert stages == ["journey: the forward pass over 8 tokens ...", "journey: integrated gradients ...",
                      "journey: the logit lens and the tensors' summaries ...", f"journey: writing {out} ..."]
    assert out.read_text(encoding="utf-8").startswith("<!")


def test_a_lens_window_beyond_the_model_context_is_refused_at_once(tmp_path, refused):
    model = checkpoint_folder(tmp_path / "model")  # a context of 32
    data = tmp_path / "text.txt"
    data.write_text("to be or not to be " * 20, encoding="utf-8")
    out = tmp_path / "lens"
    refused(["lens", "train", "--model", model, "--data", data, "--out", out,
             "--lens-context", "100000"], "100000 is above", tmp_path, seconds=10)
    assert not out.exists()


def test_train_tuned_lens_refuses_a_window_beyond_the_context():
    import torch

    from glassformer import ModelConfig, Transformer
    from glassformer.interpret.lens import LensTraining, train_tuned_lens

    model = Transformer(ModelConfig(vocab_size=16, context_length=8, d_model=16, n_layers=1,
                                    n_heads=2)).eval()
    with pytest.raises(ValueError, match="^context: 9 tokens per window is above .* 8$"):
        train_tuned_lens(model, torch.arange(16) % 16, LensTraining(steps=1, context=9))


DOCUMENT = "the quick brown fox jumps over the lazy dog " * 6
RETRIEVALS = {  # (document, question, extra flags) -> None: answers; else the refusal's words
    "a one-token document": (("fox", "what?", []), None),
    "chunks of one token": ((DOCUMENT, "fox?", ["--chunk-tokens", "1"]), None),
    "a question of stop words, both rankings": ((DOCUMENT, "the", []), None),
    "an empty question": ((DOCUMENT, "", []), "question: empty"),
    "a blank question": ((DOCUMENT, "  ", []), "question: empty"),
    "bm25 with nothing to match": ((DOCUMENT, "the", ["--ranking", "bm25"]), "BM25 finds no word"),
}


@pytest.mark.parametrize("case", list(RETRIEVALS))
def test_retrieval_of_degenerate_inputs_answers_or_says_why(case, tmp_path, refused, capsys):
    import warnings

    from hostile_helpers import hf_folder

    (document, question, extra), message = RETRIEVALS[case]
    argv = ["generate", "--model", hf_folder(tmp_path / "model"), "--context", "retrieve",
            "--question", question, "-n", "2", "--chunk-tokens", "8", *extra, document]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy warning on the way
        if message is None:
            assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
        else:
            refused(argv, message, tmp_path)
