import json

import pytest

from glassformer.cli import main

SMALL = ["--n-layers", "1", "--d-model", "16", "--n-heads", "2", "--context-length", "16",
         "--batch-size", "4", "--eval-iters", "2", "--sample-tokens", "8", "--no-progress",
         "--warmup-iters", "1"]


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("to be or not to be, that is the question. " * 40, encoding="utf-8")
    return path


def _json(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1  # one JSON object, nothing else on stdout
    return json.loads(out[0])


def test_train_json_resume_and_eval(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--data", str(corpus), "--out", str(out), *SMALL, "--json"]
    assert main([*args, "--max-iters", "3", "--eval-interval", "3"]) == 0
    first = _json(capsys)
    for key in ("iters", "tokens_seen", "train_loss", "val_loss", "tokens_per_second",
                "wall_seconds", "checkpoint"):
        assert key in first
    assert first["iters"] == 3 and first["tokens_seen"] == 3 * 4 * 16
    saved = json.loads((out / "latest" / "config.json").read_text())
    assert saved["model"]["d_model"] == 16 and saved["train"]["batch_size"] == 4

    # resume reuses the saved settings; only the budget is given
    assert main(["train", "--data", str(corpus), "--out", str(out), "--resume", "--max-iters",
                 "5", "--json", "--no-progress"]) == 0
    second = _json(capsys)
    assert second["iters"] == 5 and second["tokens_seen"] == 5 * 4 * 16

    assert main(["eval", "--model", str(out), "--data", str(corpus), "--json"]) == 0
    result = _json(capsys)
    assert result["perplexity"] == pytest.approx(2.718281828 ** result["loss"])
    assert result["tokens"] > 0


def test_train_from_a_config_file(corpus, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model": {"context_length": 16, "d_model": 16, "n_layers": 1, "n_heads": 2,
                  "position": "rope", "norm": "rmsnorm", "gated": True, "activation": "silu"},
        "train": {"batch_size": 2, "max_iters": 2, "eval_interval": 2, "eval_iters": 1},
    }))
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "r"), "--config",
                 str(config), "--json", "--no-progress", "--no-tie-embeddings"]) == 0
    assert _json(capsys)["iters"] == 2
    saved = json.loads((tmp_path / "r" / "latest" / "config.json").read_text())["model"]
    assert saved["position"] == "rope" and saved["tie_embeddings"] is False


@pytest.mark.parametrize(("preset", "flags", "compiled"), [
    ("shakespeare-char-gpu", [], True),  # the recipe's own value when --compile is not given
    ("shakespeare-char", [], False),
    ("shakespeare-char", ["--compile"], True),
])
def test_a_recipe_compiles_as_it_says_unless_the_flag_switches_it_on(preset, flags, compiled,
                                                                     monkeypatch, capsys):
    asked = []

    def train(data, out, model_config, train_config, **options):
        asked.append(train_config)
        return {"rank": 0}

    monkeypatch.setattr("glassformer.training.loop.train", train)
    assert main(["train", "--data", "d", "--out", "o", "--preset", preset, "--json", *flags]) == 0
    assert asked[0].compile is compiled


@pytest.mark.parametrize("case", ["missing", "empty", "short", "exists", "other-config",
                                  "bad-value"])
def test_bad_input_is_one_line_and_exit_2(case, corpus, tmp_path, capsys):
    out = tmp_path / "run"
    data = corpus
    extra = []
    if case == "missing":
        data = tmp_path / "missing.txt"
    elif case == "empty":
        data = tmp_path / "empty.txt"
        data.write_text("")
    elif case == "short":
        data = tmp_path / "short.txt"
        data.write_text("tiny")
    elif case == "bad-value":
        extra = ["--lr", "-1"]
    if case in ("exists", "other-config"):
        assert main(["train", "--data", str(corpus), "--out", str(out), *SMALL, "--max-iters",
                     "1", "--eval-interval", "1"]) == 0
        capsys.readouterr()
        extra = ["--resume", "--d-model", "32"] if case == "other-config" else []
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")} if out.exists() else {}
    code = main(["train", "--data", str(data), "--out", str(out), *SMALL, "--max-iters", "2",
                 *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("glassformer: error: ")
    if before:
        assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
