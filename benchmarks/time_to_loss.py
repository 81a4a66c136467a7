"""Wall time to a validation loss: the nanoGPT recipe vs Glassformer's two shakespeare presets.

    python benchmarks/time_to_loss.py [--data PATH] [--target 1.886] [--presets ...] [--repeats 1]

Each contender runs as its own process, timed from launch to exit (imports, data preparation,
evaluations and checkpoints included). Also printed: the time of the first evaluation at or
below the target (launch overhead added), the final validation loss and the iterations.
The baseline is nanoGPT's published CPU recipe re-expressed in plain PyTorch
(benchmarks/nanogpt_recipe.py), not nanoGPT's own code; its data preparation (prepare.py) is
done beforehand and not timed, as in nanoGPT. With --repeats N all of them run N times in turn
(each preset's ratio to the recipe taken within a round, so that a machine whose speed drifts
slows both alike), and the median of the rounds' ratios is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
from train_throughput import DEFAULT_DATA, prepare  # noqa: E402


def _timed(command: list[str]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{command[:4]} failed:\n{done.stderr[-3000:]}")
    return wall, json.loads(done.stdout.strip().splitlines()[-1])


def baseline(data: Path, tmp: Path, target: float) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    vocab = prepare(data, tmp)
    wall, result = _timed([sys.executable, str(HERE / "nanogpt_recipe.py"), str(tmp / "train.bin"),
                           str(tmp / "val.bin"), str(vocab)])
    overhead = wall - result["wall_seconds"]
    hit = next((e for e in result["evals"] if e["val_loss"] <= target), None)
    return {"name": "nanoGPT recipe", "wall_seconds": wall, "iters": result["iters"],
            "val_loss": result["evals"][-1]["val_loss"],
            "seconds_to_target": None if hit is None else hit["wall_seconds"] + overhead}


def glassformer(preset: str, data: Path, tmp: Path, target: float) -> dict:
    out = tmp / preset
    wall, summary = _timed([sys.executable, "-m", "glassformer", "train", "--preset", preset,
                            "--data", str(data), "--out", str(out), "--json", "--no-progress"])
    overhead = wall - summary["wall_seconds"]
    evals = [json.loads(line) for line in open(out / "metrics.jsonl") if "val_loss" in line]
    hit = next((e for e in evals if e["val_loss"] <= target), None)
    return {"name": preset, "wall_seconds": wall, "iters": summary["iters"],
            "val_loss": summary["val_loss"],
            "seconds_to_target": None if hit is None else hit["elapsed"] + overhead}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--target", type=float, default=1.886)
    parser.add_argument("--presets", nargs="+", default=["shakespeare-char-fast", "shakespeare-char"])
    parser.add_argument("--no-baseline", action="store_true")
    harness.add_arguments(parser, repeats=1)
    args = parser.parse_args()
    record = harness.start("time_to_loss", args)
    tmp = Path(tempfile.mkdtemp(prefix="glassformer-ttl-"))
    rounds = []
    for r in range(args.repeats):
        rows = [] if args.no_baseline else [baseline(args.data, tmp / f"recipe{r}", args.target)]
        rows += [glassformer(p, args.data, tmp / f"round{r}", args.target) for p in args.presets]
        rounds.append(rows)
        print(f"round {r + 1}, target validation loss {args.target}")
        for row in rows:
            hit = row["seconds_to_target"]
            print(f"{row['name']:22s} whole process {row['wall_seconds']:7.1f} s   "
                  f"to target {'not reached' if hit is None else f'{hit:7.1f} s'}   "
                  f"final val loss {row['val_loss']:.4f} after {row['iters']} iterations")
    if not args.no_baseline:
        for i, preset in enumerate(args.presets, start=1):
            ratios = [rows[i]["wall_seconds"] / rows[0]["wall_seconds"] for rows in rounds]
            print(f"{preset} / nanoGPT recipe whole-process time: {statistics.median(ratios):.2f}x"
                  f" (rounds: {', '.join(f'{v:.2f}' for v in ratios)})")
            record.ratio(f"{preset} / nanoGPT recipe whole-process time", statistics.median(ratios))
    for i, row in enumerate(rounds[0]):
        wall = harness.Timing(tuple(rows[i]["wall_seconds"] for rows in rounds))
        loss = harness.Timing(tuple(rows[i]["val_loss"] for rows in rounds))
        record.figure(f"{row['name']}, whole process", wall, "s", iters=row["iters"])
        record.figure(f"{row['name']}, final validation loss", loss, "loss")
    record.figure("peak memory of a contender", harness.peak_mb(children=True), "MB")
    record.notes["target"] = args.target
    record.write()
    print(json.dumps(rounds))


if __name__ == "__main__":
    main()
