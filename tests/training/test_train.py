import json
import math
import os
import signal

import pytest
import torch

from glassformer import ModelConfig, Transformer
from glassformer.formats.checkpoint import load_model, optimizer_from_safe, optimizer_to_safe
from glassformer.training import run as run_module
from glassformer.training.batches import TokenBatches
from glassformer.training.config import RECIPES, TrainConfig, get_recipe
from glassformer.training.data import TokenData, draw_starts
from glassformer.training.distributed import Process
from glassformer.training.loop import train
from glassformer.training.metrics import read_metrics
from glassformer.training.objectives import get_objective
from glassformer.training.optim import StackedMuon, make_optimizer, set_learning_rate
from glassformer.training.schedule import learning_rate
from glassformer.training.step import autocast, bf16_supported, evaluate, lm_loss, train_step

MODEL = ModelConfig(vocab_size=1, context_length=16, d_model=32, n_layers=2, n_heads=2,
                    dropout=0.1)
TRAIN = TrainConfig(batch_size=4, max_iters=8, warmup_iters=2, eval_interval=4, eval_iters=2,
                    log_interval=1, sample_tokens=12, device="cpu", lr=3e-3)
WORDS = "the king and queen of a far land spoke to their people at dawn".split()


@pytest.fixture()
def corpus(tmp_path):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(WORDS), (600,), generator=g).tolist()
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(WORDS[i] for i in ids) + "\n", encoding="utf-8")
    return path


def _train_losses(out):
    return {r["iter"]: r["train_loss"] for r in read_metrics(out / "metrics.jsonl") if "lr" in r}


def test_schedule_warmup_cosine_floor():
    lr = lambda s: learning_rate(s, 1e-3, 1e-4, 10, 110)  # noqa: E731
    assert lr(0) == pytest.approx(1e-4) and lr(9) == pytest.approx(1e-3)
    assert lr(10) == pytest.approx(1e-3)
    assert lr(60) == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway through the cosine
    assert lr(35) == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi / 4)) * 9e-4)
    assert lr(110) == lr(5000) == pytest.approx(1e-4)
    values = [lr(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_optimizer_decays_matrices_only():
    model = Transformer(MODEL.replace(vocab_size=10))
    opt = make_optimizer(model, TRAIN)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert any(p is model.lm_head.weight for p in decay["params"])  # tied: counted once
    assert decay["fused"]


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = Transformer(MODEL.replace(vocab_size=10))
    opt = make_optimizer(model, TRAIN.replace(optimizer="muon", muon_lr=0.05))
    muon, adamw = opt.optimizers
    assert isinstance(muon, StackedMuon) and isinstance(adamw, torch.optim.AdamW)
    hidden = {id(p) for g in muon.param_groups for p in g["params"]}
    rest = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert not hidden & rest and len(hidden | rest) == len(list(model.parameters()))
    assert hidden == {id(m.weight) for b in model.blocks
                      for m in (b.attn.qkv, b.attn.out, b.mlp.up, b.mlp.down)}
    assert id(model.lm_head.weight) in rest  # the tied embedding stays with AdamW
    set_learning_rate(opt, 1e-3, TRAIN)  # a third of the peak: both rates scale alike
    assert muon.param_groups[0]["lr"] == pytest.approx(0.05 / 3)
    assert all(g["lr"] == pytest.approx(1e-3) for g in adamw.param_groups)


@pytest.mark.parametrize("options", [{}, {"nesterov": False, "adjust_lr_fn": "match_rms_adamw"}])
def test_stacked_muon_equals_torch_muon(options):
    g = torch.Generator().manual_seed(0)
    shapes = [(24, 8), (8, 8), (24, 8), (8, 20), (8, 20), (8, 8)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    stacked = StackedMuon(ours, lr=0.03, weight_decay=0.1, ns_dtype=torch.bfloat16, **options)
    reference = torch.optim.Muon(theirs, lr=0.03, weight_decay=0.1, **options)
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        stacked.step()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        torch.testing.assert_close(stacked.state[a]["momentum_buffer"],
                                   reference.state[b]["momentum_buffer"], rtol=0, atol=1e-6)


def _plain_muon_step(p, grad, buffer, lr, weight_decay, momentum=0.95, steps=5):
    """torch.optim.Muon's update written out for one matrix, in float64."""
    a, b, c = torch.optim._muon.DEFAULT_A, torch.optim._muon.DEFAULT_B, torch.optim._muon.DEFAULT_C
    buffer.lerp_(grad, 1 - momentum)
    x = grad.double().lerp(buffer.double(), momentum)
    x = x.T if x.shape[0] > x.shape[1] else x
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.T if p.shape[0] > p.shape[1] else x
    scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5  # torch's default adjust_lr
    return (p.double() * (1 - lr * weight_decay) - lr * scale * x).float()


def test_float32_newton_schulz_is_the_plain_muon_update():
    g = torch.Generator().manual_seed(1)
    shapes = [(24, 8), (8, 8), (24, 8), (8, 20), (8, 12)]  # the long side ≥ 2× the short: by the Gram matrix
    ours = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]
    plain = [p.detach().clone() for p in ours]
    buffers = [torch.zeros_like(p) for p in plain]
    stacked = StackedMuon(ours, lr=0.03, weight_decay=0.1, ns_dtype=torch.float32)
    for _ in range(3):
        for i, p in enumerate(ours):
            p.grad = torch.randn(p.shape, generator=g)
            plain[i] = _plain_muon_step(plain[i], p.grad, buffers[i], 0.03, 0.1)
        stacked.step()
    for p, expected in zip(ours, plain, strict=True):
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize(("has_bf16", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_newton_schulz_runs_in_bf16_only_where_bf16_products_pay(
        monkeypatch, has_bf16, expected):
    from glassformer.training import optim

    monkeypatch.setenv("GLASSFORMER_BF16", "1" if has_bf16 else "0")  # the decision, as given
    assert optim.newton_schulz_dtype(torch.device("cpu")) == expected
    assert bf16_supported(torch.device("cpu")) == has_bf16
    seen = []
    monkeypatch.setattr(optim.kernels, "available", lambda: False)  # the PyTorch step: orthogonalize
    monkeypatch.setattr(optim, "orthogonalize",
                        lambda *args: seen.append(args[-1]) or torch.zeros(1, 8, 8))
    p = torch.nn.Parameter(torch.zeros(8, 8))
    p.grad = torch.ones(8, 8)
    StackedMuon([p], lr=0.01).step()
    assert seen == [expected]


def test_muon_and_adamw_state_round_trips_through_a_checkpoint():
    torch.manual_seed(0)
    config, x = TRAIN.replace(optimizer="muon"), torch.randint(0, 10, (4, 16))
    models = [Transformer(MODEL.replace(vocab_size=10, dropout=0.0)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [make_optimizer(m, config) for m in models]
    amp = torch.autocast("cpu", enabled=False)
    train_step(models[0], opts[0], x, x, 1, 1.0, amp)
    models[1].load_state_dict(models[0].state_dict())
    tensors, meta = optimizer_to_safe(opts[0])
    assert any("momentum_buffer" in k for k in tensors) and any("exp_avg" in k for k in tensors)
    saved = {k: v.clone() for k, v in tensors.items()}, json.loads(json.dumps(meta))  # a file's
    opts[1].load_state_dict(optimizer_from_safe(*saved))
    for model, opt in zip(models, opts, strict=True):
        train_step(model, opt, x, x, 1, 1.0, amp)
    for name, tensor in models[0].state_dict().items():
        torch.testing.assert_close(models[1].state_dict()[name], tensor, msg=name)


def test_accumulation_equals_one_large_batch():
    config = MODEL.replace(vocab_size=10, dropout=0.0)
    x = torch.randint(0, 10, (8, 16))
    y = torch.randint(0, 10, (8, 16))
    results = []
    for accum in (1, 4):
        torch.manual_seed(0)
        model = Transformer(config)
        opt = make_optimizer(model, TRAIN)
        loss = train_step(model, opt, x, y, accum, 1.0, torch.autocast("cpu", enabled=False))
        results.append((loss, model.state_dict()))
    torch.testing.assert_close(results[0][0], results[1][0])
    for name, tensor in results[0][1].items():
        torch.testing.assert_close(tensor, results[1][1][name], msg=name)


def test_clipping_bounds_the_update():
    torch.manual_seed(0)
    model = Transformer(MODEL.replace(vocab_size=10, dropout=0.0))
    x = torch.randint(0, 10, (2, 16))
    lm_loss(model, x, x).mul(1e4).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    total = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
    assert norm > 1.0 and total == pytest.approx(1.0, rel=1e-4)


def test_train_end_to_end(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    summary = train(corpus, out, MODEL, TRAIN, progress=False)
    for key in ("iters", "tokens_seen", "train_loss", "val_loss", "tokens_per_second",
                "wall_seconds", "checkpoint"):
        assert key in summary
    assert summary["iters"] == 8 and summary["tokens_seen"] == 8 * 4 * 16
    assert (out / "loss.png").stat().st_size > 1000
    records = read_metrics(out / "metrics.jsonl")
    evals = [r for r in records if "val_loss" in r]
    assert [r["iter"] for r in evals] == [4, 8] and all(r["sample"] for r in evals)
    assert evals[1]["val_loss"] < evals[0]["val_loss"] < math.log(summary_vocab(out))
    assert evals[1]["val_perplexity"] == pytest.approx(math.exp(evals[1]["val_loss"]))

    # The checkpoint reproduces the logged validation loss on the same fixed windows.
    model, tokenizer, meta = load_model(out)
    assert meta["state"]["step"] == 8
    assert TrainConfig.from_dict(meta["train"]) == TRAIN
    data = TokenData.open(out / "tokens.bin", 16, TRAIN.val_fraction)
    starts = draw_starts(len(data.val), 16, 8, torch.Generator().manual_seed(TRAIN.seed + 1))
    batches = TokenBatches(data, get_objective("clm"), tokenizer, 16, 8, TRAIN.seed, 0, 1)
    assert torch.equal(batches.val_starts, starts)
    again = evaluate(model, batches, 4, Process(), torch.autocast("cpu", enabled=False))
    assert again == pytest.approx(summary["val_loss"], rel=1e-5)


def summary_vocab(out):
    return json.loads((out / "latest" / "config.json").read_text())["model"]["vocab_size"]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_interrupted_and_resumed_equals_uninterrupted(corpus, tmp_path, monkeypatch, optimizer):
    config = TRAIN.replace(optimizer=optimizer)
    full = tmp_path / "full"
    train(corpus, full, MODEL, config, progress=False)

    part = tmp_path / "part"
    real_step, calls = run_module.train_step, []

    def step_then_ctrl_c(*args):  # Ctrl-C arrives during the third step
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(*args)

    monkeypatch.setattr(run_module, "train_step", step_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        train(corpus, part, MODEL, config, progress=False)
    monkeypatch.undo()
    assert json.loads((part / "latest" / "config.json").read_text())["state"]["step"] == 3

    # A budget (max_iters) may change on resume; the schedule is pinned by lr_decay_iters.
    pinned = config.replace(lr_decay_iters=8)
    train(corpus, part, MODEL, pinned.replace(max_iters=6), resume=True, progress=False)
    summary = train(corpus, part, MODEL, pinned, resume=True, progress=False)
    a, b = _train_losses(full), _train_losses(part)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    torch.testing.assert_close(torch.tensor([b[i] for i in a]), torch.tensor(list(a.values())))
    full_model, _, _ = load_model(full)
    part_model, _, _ = load_model(part)
    for name, tensor in full_model.state_dict().items():
        torch.testing.assert_close(part_model.state_dict()[name], tensor, msg=name)
    assert summary["iters"] == 8


def test_refusals_leave_the_run_untouched(corpus, tmp_path):
    out = tmp_path / "run"
    train(corpus, out, MODEL, TRAIN.replace(max_iters=2, eval_interval=2), progress=False)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(ValueError, match="already holds a training run"):
        train(corpus, out, MODEL, TRAIN, progress=False)
    with pytest.raises(ValueError, match="cannot resume.*d_model=64"):
        train(corpus, out, MODEL.replace(d_model=64), TRAIN, resume=True, progress=False)
    with pytest.raises(ValueError, match="cannot resume.*lr="):
        train(corpus, out, MODEL, TRAIN.replace(lr=1.0), resume=True, progress=False)
    with pytest.raises(FileNotFoundError, match="not found"):
        train(tmp_path / "nope.txt", out, MODEL, TRAIN, resume=True, progress=False)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(corpus, tmp_path / "fresh", MODEL, TRAIN, resume=True, progress=False)


def test_corpus_shorter_than_a_window(tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("too short for a window of sixteen tokens")
    with pytest.raises(ValueError, match="corpus too short"):
        train(tiny, tmp_path / "run", MODEL, TRAIN, progress=False)


@pytest.mark.skipif(not bf16_supported(torch.device("cpu")), reason="no bf16 on this CPU")
def test_bf16_autocast_step_tracks_float32():
    config = MODEL.replace(vocab_size=10, dropout=0.0)
    x = torch.randint(0, 10, (4, 16))
    losses = []
    for amp in (torch.autocast("cpu", enabled=False), autocast(
            torch.device("cpu"), "bfloat16")):
        torch.manual_seed(0)
        model = Transformer(config)
        losses.append(train_step(model, make_optimizer(model, TRAIN), x, x, 1, 1.0, amp))
    torch.testing.assert_close(losses[0], losses[1], atol=2e-2, rtol=0)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_trains_its_model_with_its_settings(name, corpus, tmp_path):
    recipe = get_recipe(name)
    config = recipe.train.replace(max_iters=2, eval_interval=2, eval_iters=1, batch_size=2,
                                  device="cpu", compile=False)  # compiled: tests/training/test_head_loss.py
    out = tmp_path / name
    summary = train(corpus, out, recipe.model, config, progress=False)
    assert summary["iters"] == 2 and math.isfinite(summary["val_loss"])
    model, tokenizer, meta = load_model(out)
    assert tokenizer.vocab_size < recipe.model.vocab_size  # the corpus has fewer characters
    assert model.config == recipe.model.replace(vocab_size=tokenizer.vocab_size)
    assert TrainConfig.from_dict(meta["train"]) == config  # saved as given: derived values stay derived


def test_unknown_recipe_and_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="unknown preset 'nope'; known: shakespeare-char"):
        get_recipe("nope")
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)
