"""Running an experiment as a list of cells that can be resumed.

A cell is one unit of work (train one model, time one context length ...) whose result is a
JSON object. After every cell `results.json` is rewritten atomically, so an interrupted run
picks up where it stopped: a finished cell is never run again. A run folder belongs to one
experiment at one set of settings; asking for other settings in the same folder is refused
rather than mixing results that were not measured alike.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import InputError
from ..formats.files import read_json_object, write_atomic

RESULTS = "results.json"


@dataclass
class Context:
    """What a cell sees: the run folder, the settings and every result finished so far."""

    out: Path
    settings: dict
    results: dict[str, dict]

    def folder(self, key: str) -> Path:
        """A fresh work folder for cell `key` (what an interrupted attempt left is removed)."""
        path = self.out / "cells" / key.replace("/", "_")
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path

    def kept(self, key: str) -> Path:
        """The work folder a finished cell `key` left behind."""
        return self.out / "cells" / key.replace("/", "_")


@dataclass
class Cell:
    key: str
    run: Callable[[Context], dict]
    label: str = ""


@dataclass
class Summary:
    """What an experiment found: tables, figures (PNG names in the run folder) and claims."""

    tables: list[dict] = field(default_factory=list)  # {title, columns, rows, note}
    figures: list[dict] = field(default_factory=list)  # {file, caption}
    claims: list[dict] = field(default_factory=list)  # {claim, held: True/False/None, evidence}

    def to_dict(self) -> dict:
        return {"tables": self.tables, "figures": self.figures, "claims": self.claims}


def cpu_name() -> str:
    """This machine's processor, as /proc/cpuinfo names it where it can."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def device_name(device: str | torch.device) -> str:
    """What computes on `device`: the GPU's name for a CUDA device, else the CPU's."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def machine() -> dict:
    """The CPU (and GPU) the numbers came from, and the threads torch used."""
    cpu = cpu_name()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    load = os.getloadavg()[1] if hasattr(os, "getloadavg") else None  # other work competing
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "gpu": gpu,
            "torch": torch.__version__, "load_average_5min": load}


class Runner:
    """Runs `cells` into `out`, resuming from `out/results.json` when it holds the same plan."""

    def __init__(self, out: str | Path, experiment: str, settings: dict) -> None:
        self.out, self.experiment, self.settings = Path(out), experiment, settings
        self.record = self._open()

    def _open(self) -> dict:
        path = self.out / RESULTS
        if path.is_file():
            record = read_json_object(path)
            if record.get("experiment") != self.experiment:
                raise InputError(None, f"{self.out} holds the {record.get('experiment')!r} experiment; "
                                 "choose another --out")
            if record.get("settings") != self.settings:
                changed = sorted(k for k in {*self.settings, *record.get("settings", {})}
                                 if record["settings"].get(k) != self.settings.get(k))
                raise InputError(None, f"{self.out} holds a run with other settings ({', '.join(changed)}); "
                                 "rerun with the same --budget and --data, or choose another --out")
            return record
        if self.out.exists() and any(self.out.iterdir()):
            raise InputError(None, f"{self.out} is not empty and holds no experiment; choose another --out")
        return {"experiment": self.experiment, "settings": self.settings, "cells": {},
                "machine": machine()}

    @property
    def results(self) -> dict[str, dict]:
        return self.record["cells"]

    def run(self, cells: list[Cell], progress: bool = True) -> dict[str, dict]:
        """Run every cell not already finished, saving after each one."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.save()  # the folder is this experiment's from the start
        context = Context(self.out, self.settings, self.results)
        bar = tqdm(total=len(cells), disable=not progress, unit="cell", dynamic_ncols=True,
                   desc=self.experiment)
        try:
            for cell in cells:
                bar.set_postfix_str(cell.label or cell.key, refresh=True)
                if cell.key not in self.results:
                    started = time.perf_counter()
                    result = cell.run(context)
                    result["cell_seconds"] = time.perf_counter() - started
                    self.results[cell.key] = result
                    self.save()
                bar.update(1)
        finally:
            bar.close()
        return self.results

    def finish(self, summary: Summary) -> None:
        self.record["summary"] = summary.to_dict()
        self.record["machine"] = machine()
        self.save()

    def save(self) -> None:
        write_atomic(self.out / RESULTS, json.dumps(self.record, indent=1, allow_nan=False))
