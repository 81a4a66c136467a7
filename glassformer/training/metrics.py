"""What a person watches while training runs: metrics as JSON lines and a loss-curve PNG."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


class MetricsLog:
    """Appends one JSON object per line to `path` (only where `enabled`, i.e. on rank 0)."""

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled

    def append(self, record: dict) -> None:
        """JSON has no NaN or infinity: a non-finite number is written as null."""
        if self.enabled:
            record = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                      for k, v in record.items()}
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, allow_nan=False) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (logged after the checkpoint a run resumes from), and a
        line a killed run left half-written."""
        if not (self.enabled and self.path.is_file()):
            return
        kept = [r for r in read_metrics(self.path, torn=True) if r.get("iter", 0) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, self.path)


def read_metrics(path: str | Path, torn: bool = False) -> list[dict]:
    """The records of a metrics.jsonl; with `torn`, lines that are not whole JSON objects
    (a write cut short by a kill) are skipped."""
    records = []
    with open(path, encoding="utf-8", errors="replace" if torn else "strict") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if not torn:
                    raise
                continue
            if isinstance(record, dict) or not torn:
                records.append(record)
    return records


def plot_losses(metrics_path: str | Path, png_path: str | Path) -> None:
    """Training and validation loss against the iteration, as a PNG (a bare matplotlib
    Figure: no pyplot, no global state)."""
    from matplotlib.figure import Figure

    records = read_metrics(metrics_path)
    train = [(r["iter"], r["train_loss"]) for r in records if "lr" in r and r["train_loss"] is not None]
    val = [(r["iter"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train, strict=True), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation", linewidth=1.5)
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = Path(png_path).with_name(Path(png_path).name + ".tmp.png")
    fig.savefig(tmp)
    os.replace(tmp, png_path)
