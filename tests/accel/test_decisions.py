"""The CPU decisions follow their measurements (faked both ways), are kept per CPU and torch
and reused, yield to the environment, and survive a corrupt record."""

from __future__ import annotations

import json

import pytest
import torch

from glassformer.accel import build, decisions, onednn
from glassformer.accel import kernels as accel_kernels
from glassformer.accel.cpu import CpuFeatures, cpu_features
from glassformer.cli import main

# name -> (the decision, its default, the alternative)
DECISIONS = {
    "bf16_products": (decisions.bf16_products, "float32", "bfloat16"),
    "onednn_products": (onednn.onednn_products, "mkl", "onednn"),
    "kernel_target": (decisions.kernel_target, "native", "avx2"),
}
CACHED = (decisions._bf16_products, onednn._onednn_products, decisions._kernel_target)
VARIABLES = ("GLASSFORMER_BF16", "GLASSFORMER_ONEDNN", "GLASSFORMER_KERNEL_TARGET",
             "GLASSFORMER_KERNELS")


def forget():
    for cached in CACHED:
        cached.cache_clear()


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A CPU on which every decision is measured (bfloat16 arithmetic, oneDNN, AVX-512 and both
    builds), records under tmp_path, and the measurement faked: `machine.figures` is what it
    reports, `machine.calls` counts it."""
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("GLASSFORMER_HOME", str(tmp_path))
    features = CpuFeatures("fake", avx2=True, avx512=True, avx512_bf16=True)
    monkeypatch.setattr(decisions, "cpu_features", lambda: features)
    monkeypatch.setattr(decisions, "parse", lambda text, capability: features)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(onednn, "available", lambda: True)
    monkeypatch.setattr(build, "built", lambda target: True)

    class Fake:
        figures: dict[str, float] = {}
        calls: list[list[str]] = []

    def measure(options):
        Fake.calls.append(sorted(options))
        return {name: Fake.figures[name] for name in options}

    monkeypatch.setattr(decisions, "time_options", measure)
    forget()
    yield Fake
    forget()


@pytest.mark.parametrize("name", DECISIONS)
@pytest.mark.parametrize("alternative_wins", [True, False])
def test_the_decision_follows_the_measurement(machine, name, alternative_wins, capsys):
    decide, default, alternative = DECISIONS[name]
    faster, slower = 0.010, 0.020
    machine.figures = {default: slower if alternative_wins else faster,
                       alternative: faster if alternative_wins else slower}
    decision = decide()
    assert decision.choice == (alternative if alternative_wins else default)
    assert (decision.source, decision.figures) == ("measured", machine.figures)
    assert machine.calls == [sorted((default, alternative))]
    assert f"measuring {name} once" in capsys.readouterr().err  # the one-line notice


@pytest.mark.parametrize("name", DECISIONS)
def test_an_alternative_within_the_margin_leaves_the_default(machine, name):
    decide, default, alternative = DECISIONS[name]
    machine.figures = {default: 0.0100, alternative: 0.0099}  # 1% is noise
    assert decide().choice == default


@pytest.mark.parametrize("name", DECISIONS)
def test_the_record_is_reused_by_the_next_process_and_keyed_by_cpu_and_torch(
        machine, name, monkeypatch, capsys):
    decide, default, alternative = DECISIONS[name]
    machine.figures = {default: 0.02, alternative: 0.01}
    measured = decide()
    forget()  # a new process: only the record remains
    machine.figures = {default: 0.01, alternative: 0.02}  # would decide otherwise
    cached = decide()
    assert (cached.choice, cached.figures, cached.source) == (alternative, measured.figures, "cached")
    assert len(machine.calls) == 1
    assert decide() is cached  # within a process: not even the record is read again
    capsys.readouterr()
    monkeypatch.setattr(torch, "__version__", "0.0-another")
    forget()
    assert (decide().choice, len(machine.calls)) == (default, 2)
    monkeypatch.setattr(decisions, "cpu_identity", lambda: "another CPU")
    forget()
    assert (decide().source, len(machine.calls)) == ("measured", 3)


@pytest.mark.parametrize("text", ["{not json", '{"name": "bf16_products"}', "[1, 2]",
                                  '{"name": "bf16_products", "choice": "int3", '
                                  '"figures": {"float32": 1, "bfloat16": 2}}'])
def test_a_corrupt_record_is_measured_again(machine, text):
    machine.figures = {"float32": 0.01, "bfloat16": 0.02}
    path = decisions.record_path("bf16_products", repr(decisions.TRAINING_SHAPES))
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert (decisions.bf16_products().source, len(machine.calls)) == ("measured", 1)
    assert json.loads(path.read_text())["choice"] == "float32"  # rewritten whole


@pytest.mark.parametrize(("variable", "value", "name", "choice"), [
    ("GLASSFORMER_BF16", "1", "bf16_products", "bfloat16"),
    ("GLASSFORMER_BF16", "0", "bf16_products", "float32"),
    ("GLASSFORMER_ONEDNN", "1", "onednn_products", "onednn"),
    ("GLASSFORMER_ONEDNN", "0", "onednn_products", "mkl"),
    ("GLASSFORMER_KERNELS", "torch", "onednn_products", "mkl"),
    ("GLASSFORMER_KERNEL_TARGET", "avx2", "kernel_target", "avx2"),
    ("GLASSFORMER_KERNEL_TARGET", "native", "kernel_target", "native")])
def test_the_environment_overrides_without_measuring(machine, monkeypatch, variable, value, name,
                                                     choice):
    decide, default, alternative = DECISIONS[name]
    machine.figures = {default: 0.01, alternative: 0.01}
    monkeypatch.setenv(variable, value)
    decision = decide()
    assert (decision.choice, decision.source, machine.calls) == (choice, "environment", [])
    assert variable in decision.note


def test_an_unknown_setting_is_refused_by_name(machine, monkeypatch):
    monkeypatch.setenv("GLASSFORMER_KERNEL_TARGET", "avx9")
    with pytest.raises(ValueError, match="^GLASSFORMER_KERNEL_TARGET must be one of native, avx2"):
        decisions.kernel_target()


def test_flags_rule_an_option_out_never_in(machine, monkeypatch):
    machine.figures = {"float32": 0.02, "bfloat16": 0.01, "mkl": 0.02, "onednn": 0.01,
                       "native": 0.02, "avx2": 0.01}
    monkeypatch.setattr(decisions, "cpu_features", lambda: CpuFeatures("no bf16", avx2=True))
    monkeypatch.setattr(onednn, "available", lambda: False)
    monkeypatch.setattr(build, "built", lambda target: target == "native")
    found = [decide() for decide, _, _ in DECISIONS.values()]
    assert [(d.choice, d.source) for d in found] == [("float32", "ruled out"), ("mkl", "ruled out"),
                                                     ("native", "ruled out")]
    assert machine.calls == []
    forget()
    monkeypatch.setattr(decisions, "parse", lambda text, capability: CpuFeatures("avx2", avx2=True))
    monkeypatch.setattr(build, "built", lambda target: True)
    assert decisions.kernel_target().note == "no AVX-512: native is AVX2"
    forget()
    monkeypatch.setattr(decisions, "parse", lambda text, capability: CpuFeatures("z4", avx512=True))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert decisions.kernel_target().choice == "avx2"  # ATEN_CPU_CAPABILITY=avx2: as AVX2 does
    assert machine.calls == []


def test_the_call_sites_follow_the_decisions(machine, monkeypatch):
    from glassformer.accel.fast_training import use_fast_training
    from glassformer.model.config import ModelConfig
    from glassformer.model.transformer import Transformer
    from glassformer.training import loop, optim

    machine.figures = {"float32": 0.02, "bfloat16": 0.01, "mkl": 0.01, "onednn": 0.02}
    assert loop.bf16_supported(torch.device("cpu"))
    assert optim.newton_schulz_dtype(torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr("glassformer.accel.kernels.available", lambda: False)
    model = use_fast_training(Transformer(ModelConfig(vocab_size=16, context_length=8, d_model=16,
                                                      n_layers=1, n_heads=2)))
    assert not any(isinstance(m, onednn.OneDNNLinear) for m in model.modules())  # mkl won
    loaded = []
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_load", lambda target: loaded.append(target) or "faked")
    machine.figures.update(native=0.02, avx2=0.01)
    accel_kernels.extension()
    assert loaded == ["avx2"]


def test_info_system_shows_each_decision(machine, capsys):
    machine.figures = {"float32": 0.002, "bfloat16": 0.001, "mkl": 0.001, "onednn": 0.002,
                       "native": 0.001, "avx2": 0.002}
    assert main(["info", "--cpu", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["cpu"] == cpu_features().summary()  # the CPU line
    assert [(d["name"], d["choice"], d["source"]) for d in shown["decisions"]] == [
        ("bf16_products", "bfloat16", "measured"), ("onednn_products", "mkl", "measured"),
        ("kernel_target", "native", "measured")]
    forget()  # a later process: from the records
    assert main(["info", "--cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "bfloat16 (cached); float32 2.00 ms, bfloat16 1.00 ms" in lines[1]


def test_time_options_keeps_each_best_and_stops_running_a_clear_loser(monkeypatch):
    durations = {"quick": [0.03, 0.01, 0.02, 0.01], "steady": [0.03, 0.02, 0.02, 0.02],
                 "hopeless": [0.5]}
    runs = {name: iter(times) for name, times in durations.items()}
    monkeypatch.setattr(decisions, "_timed", lambda run: run())
    best = decisions.time_options({name: runs[name].__next__ for name in durations})
    assert best == {"quick": 0.01, "steady": 0.02, "hopeless": 0.5}  # each list used up exactly
    assert all(next(times, None) is None for times in runs.values())


def test_the_real_measurements_run(monkeypatch):
    monkeypatch.setattr(decisions, "TRAINING_SHAPES", ((16, 8, 24),))  # the same code, quicker
    options = decisions._bf16_options()
    if onednn.available():
        options |= onednn._onednn_options()
    if all(build.built(target) for target in build.TARGETS):
        options |= decisions._kernel_options()
    figures = decisions.time_options(options)
    assert figures.keys() == options.keys()
    assert all(0 < seconds < 60 for seconds in figures.values())
