"""One way to time a benchmark, describe the machine and keep the result.

Every benchmark takes `--repeats N` (timed rounds per figure), reports each figure as the
median of its rounds with the min and max beside it, prints the CPU line first, and writes one
JSON record to `benchmarks/results/` (`--results DIR`; `--no-record` writes none):

    {"benchmark": "t5_generate", "when": "2026-11-25T15:09:28+00:00", "argv": [...],
     "args": {...}, "machine": {"cpu": "...", "threads": 2, "load_average": [0.3, 0.4, 0.5],
     "commit": "8b6c340...", "dirty": false, "python": "3.11.9", "torch": "2.13.0"},
     "figures": [{"name": "glassformer", "unit": "s", "median": 4.07, "min": 4.01,
                  "max": 4.2, "repeats": 3}, ...],
     "ratios": {"transformers / glassformer": 1.38}, "notes": {...}}

`benchmarks/tables.py` turns the records into the documentation's performance tables.
Competitors are timed in alternating rounds (`alternating`), so a change in the machine's load
falls on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from glassformer.accel import threads
from glassformer.accel.cpu import cpu_features

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_line(window: float = 0.2) -> str:
    """The machine a figure comes from: the CPU model, the vector features that choose the fast
    paths (glassformer/accel/cpu.py), PyTorch's dispatch level, the threads, and how busy the
    cores are right now ("loaded" when other processes hold more than a fifth of a core)."""
    import torch

    cores = threads.allowed_cores()
    before = threads.snapshot(cores)
    time.sleep(window)
    busy = len(cores) - threads.free_cores(before, threads.snapshot(cores), len(cores))
    return (f"CPU {cpu_features().summary()}; dispatch {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads on {len(cores)} cores, others using {busy:.1f} "
            f"({'loaded' if busy > 0.2 else 'quiet'} machine)")


@dataclass(frozen=True)
class Timing:
    """The samples of one figure (seconds per round, or any unit after `per` / `scaled`)."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def per(self, count: float) -> Timing:
        """A rate: `count` items per round, e.g. tokens per second."""
        return Timing(tuple(count / s for s in self.samples))

    def scaled(self, factor: float) -> Timing:
        """The same samples in another unit, e.g. `scaled(1e3)` for milliseconds."""
        return Timing(tuple(s * factor for s in self.samples))

    def text(self, unit: str, digits: int = 2) -> str:
        return (f"{self.median:,.{digits}f} {unit} (min {self.min:,.{digits}f}, "
                f"max {self.max:,.{digits}f}, {len(self.samples)} rounds)")


def timed(run: Callable[[], object], repeats: int, warmup: int = 1) -> Timing:
    """Seconds per call of `run`: `warmup` untimed calls, then `repeats` timed ones."""
    return alternating({"run": run}, repeats, warmup)["run"]


def alternating(runs: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, Timing]:
    """Seconds per call of each contender, their rounds interleaved (a, b, a, b, ...)."""
    if repeats < 1:
        raise ValueError(f"--repeats: must be at least 1, got {repeats}")
    for _ in range(warmup):
        for run in runs.values():
            run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    return {name: Timing(tuple(values)) for name, values in samples.items()}


def peak_mb(children: bool = False) -> float:
    """Peak resident memory of this process (or of its finished children), in MB."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF)
    return usage.ru_maxrss / 1024  # Linux reports KiB


def add_arguments(parser: argparse.ArgumentParser, repeats: int | None) -> None:
    """The flags every benchmark shares (`repeats` None: one that times nothing, so no --repeats)."""
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats,
                            help=f"timed rounds per figure: median, min and max (default {repeats})")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="folder the JSON record is written to (default benchmarks/results)")
    parser.add_argument("--no-record", action="store_true", help="write no record")


def _git(*command: str) -> str | None:
    try:
        run = subprocess.run(["git", *command], cwd=RESULTS.parent, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return run.stdout.strip() if run.returncode == 0 else None


def machine(cpu: str) -> dict:
    import torch

    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


@dataclass
class Record:
    """The figures of one run, written as one JSON file by `write`."""

    benchmark: str
    args: argparse.Namespace
    cpu: str
    figures: list[dict] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)
    notes: dict[str, object] = field(default_factory=dict)

    def figure(self, name: str, value: Timing | float, unit: str, **context: object) -> None:
        """A timed figure (median, min, max of its rounds) or a single value."""
        timing = value if isinstance(value, Timing) else Timing((float(value),))
        self.figures.append({"name": name, "unit": unit, "median": timing.median, "min": timing.min,
                             "max": timing.max, "repeats": len(timing.samples), **context})

    def ratio(self, name: str, value: float) -> None:
        self.ratios[name] = value

    def write(self) -> Path | None:
        if self.args.no_record:
            return None
        when = datetime.now(timezone.utc).replace(microsecond=0)
        record = {
            "benchmark": self.benchmark,
            "when": when.isoformat(),
            "argv": sys.argv[1:],
            "args": {k: v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v)
                     for k, v in vars(self.args).items()},
            "machine": machine(self.cpu),
            "figures": self.figures,
            "ratios": self.ratios,
            "notes": self.notes,
        }
        folder = Path(self.args.results)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.benchmark}-{when.strftime('%Y%m%dT%H%M%SZ')}-{os.getpid()}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"record: {path}", file=sys.stderr)
        return path


def start(benchmark: str, args: argparse.Namespace, json_mode: bool = False) -> Record:
    """Print the CPU line (on stderr when stdout carries JSON) and open the run's record."""
    cpu = cpu_line()
    print(cpu, file=sys.stderr if json_mode else sys.stdout, flush=True)
    return Record(benchmark, args, cpu)
