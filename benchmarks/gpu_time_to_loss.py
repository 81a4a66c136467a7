"""Time to a validation loss on one GPU: nanoGPT compiled against Glassformer's GPU recipes.

    python benchmarks/gpu_time_to_loss.py --out DIR [--target 1.47] [--nanogpt ../shared/nanoGPT]

Each contender runs as its own process and is timed from its launch (imports, data
preparation, compilation, evaluations and checkpoints included) to the first evaluation it
prints at or below the target; it is stopped there, or at its time cap. The contenders:
- nanoGPT compiled: nanoGPT's own code (karpathy/nanoGPT: train.py, model.py, configurator.py,
  config/) carried beside the repository, run as `train.py config/train_shakespeare_char.py`
  (its GPU recipe: bfloat16, compiled, 5000-step schedule) with --eval_iters=100 (its two
  splits then cost what the Glassformer recipe's one split of 200 batches costs). Its data is
  prepared beforehand, untimed, from the same text as its data/shakespeare_char/prepare.py does
  (sorted characters, the first 90% for training, uint16 .bin files, meta.pkl);
- `shakespeare-char-gpu`: the same recipe in Glassformer;
- `shakespeare-char-gpu-fast`: the recipe aimed at half nanoGPT's time.
Both Glassformer runs are `glassformer train --preset NAME --sample-tokens 0` (no text sample at
each evaluation: nanoGPT's loop writes none). The ratio of each to nanoGPT is
taken on time to the target; where nanoGPT does not reach it within its cap, the time it ran
stands in for its own (so the ratio is an upper bound, and `nanogpt_reached` says so).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

from glassformer.data import tinyshakespeare

ROOT = Path(__file__).resolve().parent.parent
DATA = tinyshakespeare()
NANOGPT = ROOT.parent / "shared" / "nanoGPT"
TARGET = 1.47
# Seconds each contender may run (nanoGPT first: the anchor). These sum to the training share of
# gpu_check.py's budget; a contender past its cap has missed the goal that the cap stands for.
CAPS = {"nanoGPT compiled": 130, "shakespeare-char-gpu": 110, "shakespeare-char-gpu-fast": 60}
# An evaluation line, as both print it: nanoGPT "step 250: train loss 1.98, val loss 2.07",
# Glassformer "step 250: val loss 2.0706 (perplexity 7.93) best".
EVALUATION = re.compile(r"step (\d+):.*?val loss (\d+(?:\.\d+)?)")
# What --quick changes: two steps on a CPU, a look after each, nothing compiled (torch.compile
# switched off by PyTorch's own variable), and a cap for a slow, shared CPU.
QUICK_CAP = 300
QUICK_NANOGPT = ("--device=cpu", "--compile=False", "--dtype=float32", "--max_iters=2",
                 "--eval_interval=1", "--eval_iters=1", "--batch_size=2", "--log_interval=1")
QUICK_GLASSFORMER = ("--device", "cpu", "--max-iters", "2", "--eval-interval", "1",
                     "--eval-iters", "1", "--batch-size", "2")


def prepare_nanogpt(source: Path, text: Path, folder: Path) -> Path:
    """A copy of nanoGPT's code in `folder` with its shakespeare_char data written as its
    prepare.py writes it; returns the copy."""
    copy = folder / "nanoGPT"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(".git", "out*", "*.bin", "*.pkl"))
    data = text.read_text(encoding="utf-8")
    chars = sorted(set(data))
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = np.array([stoi[ch] for ch in data], dtype=np.uint16)  # (n,)
    split = int(len(data) * 0.9)
    out = copy / "data" / "shakespeare_char"
    out.mkdir(parents=True, exist_ok=True)
    ids[:split].tofile(out / "train.bin")
    ids[split:].tofile(out / "val.bin")
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}
    with open(out / "meta.pkl", "wb") as file:  # nanoGPT reads its vocabulary from it
        pickle.dump(meta, file)
    return copy


def time_to_target(command: list[str], cwd: Path, target: float, cap: float, env: dict) -> dict:
    """Runs `command` until it prints an evaluation at or below `target`, exits, or has run
    `cap` seconds. Every evaluation is kept as [step, val loss, seconds since launch]."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                               start_new_session=True)  # its compile workers stop with it
    capped = threading.Event()

    def at_cap() -> None:
        capped.set()
        _stop(process)

    timer = threading.Timer(cap, at_cap)
    timer.start()
    evaluations, tail, reached = [], deque(maxlen=15), None
    try:
        for line in process.stdout:
            tail.append(line.rstrip())
            found = EVALUATION.search(line)
            if found:
                evaluations.append([int(found[1]), float(found[2]), round(time.perf_counter() - start, 2)])
                if evaluations[-1][1] <= target:
                    reached = evaluations[-1]
                    break
    finally:
        timer.cancel()
        _stop(process)
        exit_code = process.wait()
    result = {"reached": reached is not None,
              "seconds_to_target": None if reached is None else reached[2],
              "step_at_target": None if reached is None else reached[0],
              "seconds_run": round(time.perf_counter() - start, 2), "evaluations": evaluations,
              "stopped": "target" if reached else "cap" if capped.is_set() else f"exit {exit_code}"}
    if reached is None:
        result["tail"] = list(tail)
    return result


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)


def race(out: Path, text: Path, nanogpt: Path | None, target: float, quick: bool) -> dict:
    """Every contender in turn, nanoGPT first; the record of each and their ratios."""
    record = {"target_val_loss": target, "contenders": {}}
    contenders = record["contenders"]
    env = {"TORCH_COMPILE_DISABLE": "1"} if quick else {}
    caps = dict.fromkeys(CAPS, QUICK_CAP) if quick else CAPS
    if nanogpt is not None and (nanogpt / "train.py").is_file():
        copy = prepare_nanogpt(nanogpt, text, out)
        command = [sys.executable, "train.py", "config/train_shakespeare_char.py",
                   f"--out_dir={out / 'nanogpt-run'}", "--eval_iters=100", *(QUICK_NANOGPT if quick else ())]
        contenders["nanoGPT compiled"] = time_to_target(command, copy, target, caps["nanoGPT compiled"], env)
    else:
        contenders["nanoGPT compiled"] = {"error": f"no nanoGPT at {nanogpt} (its train.py, model.py, "
                                                   "configurator.py and config/): pass --nanogpt"}
    for preset in ("shakespeare-char-gpu", "shakespeare-char-gpu-fast"):
        command = [sys.executable, "-m", "glassformer", "train", "--preset", preset, "--data", str(text),
                   "--out", str(out / preset), "--no-progress", "--sample-tokens", "0",
                   *(QUICK_GLASSFORMER if quick else ())]
        contenders[preset] = time_to_target(command, ROOT, target, caps[preset], env)
    anchor = contenders["nanoGPT compiled"]
    record["nanogpt_reached"] = anchor.get("reached", False)
    anchor_seconds = anchor.get("seconds_to_target") or anchor.get("seconds_run")
    record["ratio_to_nanogpt"] = {
        name: round(result["seconds_to_target"] / anchor_seconds, 3)
        if result["reached"] and anchor_seconds else None
        for name, result in contenders.items() if name != "nanoGPT compiled"}
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_time_to_loss.json")
    parser.add_argument("--data", type=Path, default=DATA, help="tinyshakespeare.txt")
    parser.add_argument("--nanogpt", type=Path, default=NANOGPT, help="nanoGPT's code")
    parser.add_argument("--target", type=float, default=TARGET)
    parser.add_argument("--quick", action="store_true", help="two steps each on the CPU (a smoke test)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record = race(Path(tempfile.mkdtemp(prefix="glassformer-race-")), args.data, args.nanogpt,
                  args.target, args.quick)
    print(json.dumps(record, indent=1))
    (args.out / "gpu_time_to_loss.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
