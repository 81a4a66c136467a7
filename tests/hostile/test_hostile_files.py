"""No command writes over its own input, nor over a file it did not create without --force."""

from __future__ import annotations

import pytest
from hostile_helpers import checkpoint_folder, snapshot

from glassformer.cli import main


@pytest.fixture
def checkpoint(tmp_path):
    return checkpoint_folder(tmp_path / "ckpt")


def test_journey_never_writes_over_its_model(gguf_file, tmp_path, refused):
    model = tmp_path / "v.gguf"
    model.write_bytes(gguf_file.read_bytes())
    for force in ([], ["--force"]):
        refused(["journey", "--model", model, "-o", model, "Hi", *force], "replace the input", model)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "new.html"])
def test_journey_never_writes_into_its_model_folder(name, checkpoint, refused):
    refused(["journey", "--model", checkpoint, "-o", checkpoint / name, "hi", "--force"],
            "inside the input", checkpoint)
    assert not (checkpoint / "new.html").exists()


def test_journey_never_writes_over_its_prompt_file(checkpoint, tmp_path, refused):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hi there", encoding="utf-8")
    refused(["journey", "--model", checkpoint, "--prompt-file", prompt, "-o", prompt, "--force"],
            "replace the input", prompt, checkpoint)


@pytest.mark.parametrize("name", ["report.html", "notes.txt", "journey.html"])
def test_journey_needs_force_for_an_existing_file(name, checkpoint, tmp_path, refused, capsys):
    out = tmp_path / name
    out.write_text("someone's file", encoding="utf-8")
    refused(["journey", "--model", checkpoint, "-o", out, "hi"], "--force", out, checkpoint)
    assert main(["journey", "--model", str(checkpoint), "-o", str(out), "hi", "--force",
                 "--ig-steps", "1"]) == 0
    assert out.read_text(encoding="utf-8").startswith("<!")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", name])  # no temp left


def test_journey_default_output_is_not_replaced(checkpoint, tmp_path, refused, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "journey.html").write_text("keep me", encoding="utf-8")
    refused(["journey", "--model", checkpoint, "hi"], "--force", tmp_path / "journey.html")


@pytest.mark.parametrize("case", ["folder", "missing-parent"])
def test_journey_output_that_cannot_be_a_file(case, checkpoint, tmp_path, refused):
    out = tmp_path / "dir" if case == "folder" else tmp_path / "no" / "such" / "out.html"
    if case == "folder":
        out.mkdir()
        (out / "inside.txt").write_text("x", encoding="utf-8")
    refused(["journey", "--model", checkpoint, "-o", out, "hi", "--force", "--ig-steps", "1"],
            "", tmp_path)


@pytest.mark.parametrize("target", ["model-folder", "weights-file", "other-file", "non-empty"])
def test_export_never_writes_over_anything(target, checkpoint, tmp_path, refused):
    other = tmp_path / "other.txt"
    other.write_text("mine", encoding="utf-8")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "a.txt").write_text("a", encoding="utf-8")
    out = {"model-folder": checkpoint, "weights-file": checkpoint / "model.safetensors",
           "other-file": other, "non-empty": busy}[target]
    refused(["export", "--model", checkpoint, "-o", out], "exists", tmp_path)


def test_export_of_a_gguf_onto_itself(gguf_file, tmp_path, refused):
    model = tmp_path / "v.gguf"
    model.write_bytes(gguf_file.read_bytes())
    refused(["export", "--model", model, "-o", model], "exists", model)


def test_export_into_a_fresh_folder_leaves_the_model_as_it_was(checkpoint, tmp_path):
    before = snapshot(checkpoint)
    assert main(["export", "--model", str(checkpoint), "-o", str(tmp_path / "hf")]) == 0
    assert snapshot(checkpoint) == before
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "hf").iterdir()}


def test_train_out_that_is_a_file(tmp_path, refused):
    corpus = tmp_path / "c.txt"
    corpus.write_text("abc " * 400, encoding="utf-8")
    out = tmp_path / "out"
    out.write_text("not a folder", encoding="utf-8")
    refused(["train", "--data", corpus, "--out", out, "--n-layers", "1", "--d-model", "16",
             "--n-heads", "2", "--context-length", "8", "--no-progress"], "not a folder", out, corpus)


def test_train_data_is_never_written(tmp_path, refused):
    corpus = tmp_path / "c.txt"
    corpus.write_text("abc " * 400, encoding="utf-8")
    refused(["train", "--data", corpus, "--out", corpus, "--no-progress"], "not a folder", corpus)


def test_pull_unknown_name_writes_nothing(tmp_path, refused, monkeypatch):
    monkeypatch.setenv("GLASSFORMER_HOME", str(tmp_path / "home"))
    refused(["pull", "no-such-model"], "unknown model", tmp_path)
    assert not (tmp_path / "home").exists()


def _writers(model, gguf_model, tmp_path, out):
    """Every command that writes a file or a folder, writing to `out`."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("to be or not to be " * 50, encoding="utf-8")
    for name in ("p.txt", "n.txt"):
        (tmp_path / name).write_text("good\n", encoding="utf-8")
    return {
        "train": ["train", "--data", corpus, "--out", out, "--n-layers", "1", "--d-model", "16",
                  "--n-heads", "2", "--context-length", "8", "--no-progress", "--max-iters", "1"],
        "export": ["export", "--model", model, "-o", out],
        "export gguf": ["export", "--model", gguf_model, "--to", "gguf", "-o", out],
        "lens train": ["lens", "train", "--model", model, "--data", corpus, "--out", out,
                       "--steps", "1"],
        "lens --html": ["lens", "--model", model, "hi", "--html", out],
        "steer build": ["steer", "build", "--model", model, "--site", "blocks.0.resid_post",
                        "--positive", tmp_path / "p.txt", "--negative", tmp_path / "n.txt",
                        "--out", out],
        "journey": ["journey", "--model", model, "-o", out, "hi", "--ig-steps", "1"],
        "experiment": ["experiment", "cache", "--out", out, "--budget", "1"],
    }


WRITERS = ["train", "export", "export gguf", "lens train", "lens --html", "steer build", "journey",
           "experiment"]


@pytest.mark.parametrize("command", WRITERS)
def test_an_output_under_a_regular_file_is_refused_before_loading(command, tmp_path, refused):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine", encoding="utf-8")
    nothing = tmp_path / "no-model"  # were it read first, the error would be about it
    argv = _writers(nothing, nothing, tmp_path, blocker / "sub" / "out")[command]
    refused(argv, f"{blocker} is a file, not a folder", tmp_path)


@pytest.mark.parametrize("command", ["lens --html", "steer build", "journey"])
def test_a_file_in_a_missing_folder_is_refused_before_loading(command, tmp_path, refused):
    out, nothing = tmp_path / "no" / "such" / "out", tmp_path / "no-model"
    refused(_writers(nothing, nothing, tmp_path, out)[command], "does not exist", tmp_path)
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("command", ["train", "export", "export gguf", "lens train"])
def test_a_folder_or_export_makes_its_missing_folders(command, checkpoint, gguf_file, tmp_path):
    out = tmp_path / "no" / "such" / "out"
    argv = _writers(checkpoint, gguf_file, tmp_path, out)[command]
    assert main([str(a) for a in argv]) == 0
    assert out.exists()
