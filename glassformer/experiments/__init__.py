"""The textbook's claims as experiments anyone can rerun: each one trains or measures small
models, writes a table, plots and a self-contained report, and says what it found."""

from __future__ import annotations

from pathlib import Path

from ..data import tinyshakespeare
from ..errors import InputError
from . import ablation, decode_cache, explain, length, recall
from .report import write_html
from .runner import Runner

EXPERIMENTS = {"ablation": ablation, "length": length, "cache": decode_cache, "explain": explain,
               "recall": recall}


def run_experiment(name: str, out: str | Path, budget: float, data: str | Path | None = None,
                   progress: bool = True, device: str | None = None, **options) -> dict:
    """Run (or resume) experiment `name` into `out`; returns the record saved as results.json.
    `options` narrow an experiment's plan (see each module's `settings`); `device` is where the
    recall experiment runs its model (the others run on the CPU)."""
    if name not in EXPERIMENTS:
        raise InputError(None, f"unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)}")
    if device is not None and name != "recall":
        raise InputError("device", f"the {name} experiment runs on the CPU; only recall takes a device")
    if budget <= 0:
        raise InputError("budget", f"must be positive seconds, got {budget}")
    module, out = EXPERIMENTS[name], Path(out)
    if module.NEEDS_DATA:
        config = module.settings(budget, training_text(data), **options)
    else:
        config = module.settings(budget, **options)
    runner = Runner(out, name, config)
    results = runner.run(module.cells(config, device) if device else module.cells(config), progress)
    runner.finish(module.summarize(config, results, out))
    write_html(out, module.TITLE, runner.record)
    return runner.record


def training_text(data: str | Path | None) -> Path:
    """The text file an experiment trains on: `data`, or the packaged tinyshakespeare."""
    path = Path(data) if data else tinyshakespeare()
    if not path.is_file():
        raise FileNotFoundError(f"no text at {path}: pass --data FILE")
    return path.resolve()
