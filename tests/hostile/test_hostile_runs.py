"""Training runs that must never lose a checkpoint: copies without links, broken links,
refused and diverged runs, resumed budgets."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
from hostile_helpers import checkpoint_folder

from glassformer.cli import main
from glassformer.model.config import ModelConfig
from glassformer.training import loop, run
from glassformer.training.config import TrainConfig

SMALL = ["--n-layers", "1", "--d-model", "16", "--n-heads", "2", "--context-length", "16",
         "--batch-size", "4", "--eval-iters", "2", "--sample-tokens", "4", "--no-progress",
         "--warmup-iters", "1", "--log-interval", "1"]
MODEL = ModelConfig(vocab_size=1, context_length=16, d_model=16, n_layers=1, n_heads=2)
TRAIN = TrainConfig(batch_size=4, max_iters=4, eval_interval=2, eval_iters=2, sample_tokens=0,
                    warmup_iters=1, log_interval=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("to be or not to be, that is the question. " * 40, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):
    """A run of 4 iterations: step folders, latest, best, metrics, loss curve, tokens."""
    out = tmp_path_factory.mktemp("runs") / "run"
    loop.train(corpus, out, MODEL, TRAIN, progress=False, echo=lambda s: None)
    return out


def _copy(run, tmp_path, damage):
    out = tmp_path / "copy"
    shutil.copytree(run, out, symlinks=True)
    damage(out)
    return out


def _drop(*names):
    return lambda out: [(out / n).unlink() for n in names]


def _repoint(link, target):
    def damage(out):
        (out / link).unlink()
        os.symlink(target, out / link)
    return damage


def _keep_only(*names):
    def damage(out):
        for path in list(out.iterdir()):
            if path.name not in names:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    return damage


DAMAGE = {
    "latest-missing": _drop("latest"),
    "both-links-missing": _drop("latest", "best"),
    "latest-broken": _repoint("latest", "step-9999999"),
    "latest-to-nothing-useful": _repoint("latest", "metrics.jsonl"),
    "links-absolute-broken": _repoint("best", "/nonexistent/step-0000002"),
    "only-step-folders": _keep_only("step-0000004", "step-0000002"),
    "only-metrics": _keep_only("metrics.jsonl"),
    "only-loss-curve": _keep_only("loss.png"),
    "only-tokens": _keep_only("tokens.bin", "tokens.json"),
    "untouched": lambda out: None,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_fresh_run_never_cleans_a_folder_that_holds_a_run(damage, finished, corpus, tmp_path,
                                                            refused):
    out = _copy(finished, tmp_path, DAMAGE[damage])
    names = sorted(p.name for p in out.iterdir())
    refused(["train", "--data", corpus, "--out", out, *SMALL, "--max-iters", "2"],
            "--resume", out, corpus)
    assert sorted(p.name for p in out.iterdir()) == names  # nothing added either


@pytest.mark.parametrize("damage", ["latest-missing", "latest-broken", "both-links-missing",
                                    "only-step-folders"])
def test_resume_without_latest_says_what_is_left(damage, finished, corpus, tmp_path, refused):
    out = _copy(finished, tmp_path, DAMAGE[damage])
    line = refused(["train", "--data", corpus, "--out", out, "--resume", "--max-iters", "6",
                    "--no-progress"], "latest", out, corpus)
    assert "step-0000004" in line
    if damage in ("latest-missing", "latest-broken"):
        assert "best still points to step-0000004" in line


def test_a_pruned_copy_resumes_once_latest_is_pointed_again(finished, corpus, tmp_path):
    out = _copy(finished, tmp_path, DAMAGE["latest-missing"])
    os.symlink("step-0000004", out / "latest")
    summary = loop.train(corpus, out, MODEL, TRAIN.replace(max_iters=6), resume=True,
                         progress=False, echo=lambda s: None)
    assert summary["iters"] == 6


def test_an_unlinked_step_folder_survives_later_saves(finished, corpus, tmp_path):
    out = _copy(finished, tmp_path, lambda out: None)
    stray = out / "step-0000001"
    shutil.copytree(out / "step-0000004", stray)
    loop.train(corpus, out, MODEL, TRAIN.replace(max_iters=8), resume=True, progress=False,
               echo=lambda s: None)
    assert (stray / "model.safetensors").is_file()  # no link ever pointed to it: never removed


@pytest.mark.parametrize("case", ["short-corpus", "context-too-long", "empty-corpus"])
def test_a_refused_run_leaves_nothing_behind(case, corpus, tmp_path, refused):
    data, extra = corpus, []
    if case == "short-corpus":
        data = tmp_path / "short.txt"
        data.write_text("tiny", encoding="utf-8")
    elif case == "empty-corpus":
        data = tmp_path / "empty.txt"
        data.write_text("", encoding="utf-8")
    else:
        extra = ["--context-length", "4096"]
    out = tmp_path / "run"
    refused(["train", "--data", data, "--out", out, *SMALL, "--max-iters", "2", *extra], "",
            data)
    assert not out.exists()


def test_divergence_stops_keeps_the_last_good_checkpoint_and_valid_json(corpus, tmp_path,
                                                                        monkeypatch):
    real, calls = run.train_step, []

    def diverge_after_two(*args):
        calls.append(1)
        loss = real(*args)
        return loss * math.nan if len(calls) > 2 else loss

    monkeypatch.setattr(run, "train_step", diverge_after_two)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="diverged at step 3.*last good checkpoint.*step-0000002"):
        loop.train(corpus, out, MODEL, TRAIN, progress=False, echo=lambda s: None)
    assert os.readlink(out / "latest") == "step-0000002"
    assert (out / "step-0000002" / "model.safetensors").is_file()
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics"))
        assert record["iter"] <= 2


def test_a_huge_learning_rate_ends_in_one_line_and_valid_metrics(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--data", str(corpus), "--out", str(out), *SMALL, "--max-iters", "4",
                 "--eval-interval", "2", "--lr", "1e30", "--min-lr", "0", "--grad-clip", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "diverged" in err[0], err
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics"))


def test_metrics_write_null_for_a_non_finite_value(tmp_path):
    from glassformer.training.metrics import MetricsLog, read_metrics

    log = MetricsLog(tmp_path / "m.jsonl")
    log.append({"iter": 1, "train_loss": math.nan, "val_loss": math.inf, "lr": 1.0})
    assert read_metrics(tmp_path / "m.jsonl") == [
        {"iter": 1, "train_loss": None, "val_loss": None, "lr": 1.0}]


def test_resume_with_a_larger_budget_follows_it(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--data", str(corpus), "--out", str(out), *SMALL, "--eval-interval", "3"]
    assert main([*args, "--max-iters", "3"]) == 0
    assert json.loads((out / "latest" / "config.json").read_text())["train"]["lr_decay_iters"] is None
    assert main([*args, "--max-iters", "6", "--resume"]) == 0
    assert json.loads((out / "latest" / "config.json").read_text())["state"]["step"] == 6


def test_resume_keeps_an_explicit_decay(corpus, tmp_path):
    out = tmp_path / "run"
    pinned = TRAIN.replace(lr_decay_iters=4)
    loop.train(corpus, out, MODEL, pinned, progress=False, echo=lambda s: None)
    with pytest.raises(ValueError, match="lr_decay_iters=8 \\(saved 4\\)"):
        loop.train(corpus, out, MODEL, TRAIN.replace(max_iters=8), resume=True, progress=False)
    loop.train(corpus, out, MODEL, pinned.replace(max_iters=6), resume=True, progress=False,
               echo=lambda s: None)


BAD_TRAIN = [
    (["--lr", "inf"], "lr"), (["--lr", "nan"], "lr"), (["--lr", "-1"], "lr"),
    (["--lr", "abc"], "--lr"), (["--batch-size", "0"], "--batch-size"),
    (["--max-iters", "-5"], "--max-iters"), (["--device", "bogus"], "bogus"),
    (["--device", "cuda:99"], "cuda"), (["--n-heads", "0"], "--n-heads"),
    (["--d-model", "15"], "--d-model"), (["--dropout", "2"], "dropout"),
    (["--beta1", "1.5"], "beta1"), (["--val-fraction", "0"], "--val-fraction"),
    (["--norm-eps", "nan"], "--norm-eps"), (["--rope-theta", "inf"], "--rope-theta"),
    (["--max-time", "-1"], "--max-time"), (["--grad-clip=-inf"], "--grad-clip"),
    (["--preset", "nope"], "unknown preset"),
]


@pytest.mark.parametrize("extra, message", BAD_TRAIN, ids=[" ".join(a) for a, _ in BAD_TRAIN])
def test_bad_training_values_are_refused_before_anything_is_written(extra, message, corpus,
                                                                    tmp_path, refused):
    out = tmp_path / "run"
    refused(["train", "--data", corpus, "--out", out, *SMALL, "--max-iters", "2", *extra],
            message, corpus)
    assert not out.exists()


CONFIGS = {
    "a JSON list": (b"[1, 2]", "expected a JSON object"),
    "not JSON": (b"{model: 1", "not valid JSON"),
    "not UTF-8": (b'{"model": {"d_model": "\xff"}}', "not valid UTF-8"),
    "model a list": (b'{"model": [16]}', "objects of ModelConfig"),
    "lacks model": (b'{"train": {}}', "expected"),
    "lacks required fields": (b'{"model": {"d_model": 16}}', "required ModelConfig field"),
    "wrong type": (b'{"model": {"context_length": 16, "d_model": "16", "n_layers": 1, '
                   b'"n_heads": 2}}', "d_model"),
    "unknown field": (b'{"model": {"context_length": 16, "d_model": 16, "n_layers": 1, '
                      b'"n_heads": 2, "bogus": 1}}', "bogus"),
    "train a list": (b'{"model": {"context_length": 16, "d_model": 16, "n_layers": 1, '
                     b'"n_heads": 2}, "train": [1]}', "objects of ModelConfig"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_bad_config_files_are_one_line(case, corpus, tmp_path, refused):
    data, message = CONFIGS[case]
    config = tmp_path / "config.json"
    config.write_bytes(data)
    out = tmp_path / "run"
    refused(["train", "--data", corpus, "--out", out, "--config", config, "--no-progress"],
            message, config, corpus)
    assert not out.exists()


def test_resume_from_a_checkpoint_with_a_broken_config(finished, corpus, tmp_path, refused):
    out = _copy(finished, tmp_path, lambda out: None)
    config = out / "step-0000004" / "config.json"
    config.write_text("[]", encoding="utf-8")
    refused(["train", "--data", corpus, "--out", out, "--resume", "--no-progress"],
            "expected a JSON object", out)



BAD_LORA = {  # the model: d_model 16, two heads of 8, kv_heads 2, a 64-wide plain feed-forward
    "rank beyond every product": (["--lora-rank", "100000", "--lora-targets", "q,k,v,o,up,down"],
                                  "--lora-rank: 100000 is above 16"),
    "rank beyond the smallest target": (["--lora-rank", "17", "--lora-targets", "q,down"],
                                        "a rank of 16 or less fits"),
    "targets without a rank": (["--lora-targets", "q"], "give --lora-rank too"),
    "default targets without a rank": (["--lora-targets", "q,k,v,o,gate,up,down"],
                                       "give --lora-rank too"),
    "alpha without a rank": (["--lora-alpha", "8"], "give --lora-rank too"),
    "dropout without a rank": (["--lora-dropout", "0.1"], "give --lora-rank too"),
    "PEFT's name without a rank": (["--lora-targets", "q_proj"], "give --lora-rank too"),
    "PEFT's name": (["--lora-rank", "2", "--lora-targets", "q_proj"],
                    "among q,k,v,o,gate,up,down"),
    "a target the model lacks": (["--lora-rank", "2", "--lora-targets", "gate"],
                                 "choose among q,k,v,o,down,up"),
}


@pytest.mark.parametrize("case", list(BAD_LORA))
def test_lora_options_are_checked_against_the_model_before_any_work(case, corpus, tmp_path,
                                                                     refused):
    model = checkpoint_folder(tmp_path / "model")
    extra, message = BAD_LORA[case]
    out = tmp_path / "run"
    refused(["train", "--init", model, "--data", corpus, "--out", out, "--max-iters", "1",
             "--no-progress", *extra], message, model, corpus, seconds=10)
    assert not out.exists()


def test_the_largest_rank_a_model_allows_trains(corpus, tmp_path):
    model = checkpoint_folder(tmp_path / "model")
    summary = loop.train(corpus, tmp_path / "run", None, TRAIN.replace(
        init=str(model), lora_rank=16, lora_targets="q,down", max_iters=1, eval_interval=1),
        progress=False, echo=lambda s: None)
    assert summary["trainable_parameters"] == 16 * (16 + 16) + 16 * (64 + 16)


REPLY = {"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]}
CHATS = {  # the second line of a chat file -> the refusal
    "not UTF-8": (b'{"messages": [{"role": "user", "content": "\xff"}]}', "not valid UTF-8"),
    "the assistant first": (json.dumps({"messages": REPLY["messages"][::-1]}).encode(),
                            "chat template: UndefinedError"),
}


@pytest.mark.parametrize("case", list(CHATS))
def test_a_bad_chat_line_is_named_by_file_and_line(case, tmp_path, refused):
    import gguf
    from hostile_helpers import TEMPLATE, write_gguf

    # a default system turn, as SmolLM2's template writes: it reads messages[0]
    template = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nbe kind<|im_end|>\n"
                "{% endif %}" + TEMPLATE)
    model = write_gguf(tmp_path / "chat.gguf",
                       meta={"tokenizer.chat_template": (template, gguf.GGUFValueType.STRING)})
    line, message = CHATS[case]
    data = tmp_path / "chat.jsonl"
    data.write_bytes(json.dumps(REPLY).encode() + b"\n" + line + b"\n" + json.dumps(REPLY).encode())
    out = tmp_path / "run"
    refused(["train", "--init", model, "--data", data, "--out", out, "--max-iters", "1",
             "--no-progress"], f"{data}:2: {message}", tmp_path, seconds=10)
    assert not out.exists()


def test_a_resume_after_a_kill_logs_each_iteration_once(corpus, tmp_path):
    out = tmp_path / "run"
    loop.train(corpus, out, MODEL, TRAIN.replace(max_iters=2), progress=False, echo=lambda s: None)
    dead = [{"iter": 3, "train_loss": 9.0, "lr": 0.1, "tokens_seen": 1, "tokens_per_second": 1.0},
            {"iter": 4, "train_loss": 9.0, "lr": 0.1, "tokens_seen": 2, "tokens_per_second": 1.0},
            {"iter": 4, "val_loss": 9.0, "val_perplexity": 1.0, "train_loss": 9.0, "best": True}]
    with open(out / "metrics.jsonl", "a", encoding="utf-8") as f:  # killed past the checkpoint,
        f.write("".join(json.dumps(r) + "\n" for r in dead) + '{"iter": 5, "train_lo')  # mid-line

    def records():
        lines = (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines]

    loop.train(corpus, out, MODEL, TRAIN, resume=True, progress=False, echo=lambda s: None)
    logged = records()
    assert [r["iter"] for r in logged if "lr" in r] == [1, 2, 3, 4]
    assert [r["iter"] for r in logged if "val_loss" in r] == [2, 4]
    assert all(r["train_loss"] != 9.0 for r in logged)
    summary = loop.train(corpus, out, MODEL, TRAIN, resume=True, progress=False,
                         echo=lambda s: None)  # nothing left to train: nothing logged again
    assert records() == logged and summary["val_loss"] == logged[-1]["val_loss"]


def test_resume_from_a_truncated_training_state_names_the_file(finished, corpus, tmp_path, refused):
    out = _copy(finished, tmp_path, lambda out: None)
    state = (out / "latest").resolve() / "training_state.safetensors"
    state.write_bytes(state.read_bytes()[:100])
    refused(["train", "--data", corpus, "--out", out, "--resume", "--max-iters", "6", "--no-progress"],
            "training_state.safetensors: corrupt or truncated", corpus)
