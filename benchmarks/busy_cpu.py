"""Speed on a busy CPU: decode (SmolLM2-135M fp32 and int4) and training (shakespeare-char),
each quiet and beside a process that keeps one core busy, with PyTorch's default threads and
with Glassformer's choice (glassformer/accel/threads.py).

    python benchmarks/busy_cpu.py [--tokens 64] [--iters 40] [--repeats 1] [--only decode-fp32 ...]

Each figure is its own process (OpenMP's wait policy is fixed when torch loads): "default"
keeps one thread per core and libgomp's spinning waits (GOMP_SPINCOUNT=300000, its default);
"threads" is what the `glassformer` command does: one thread per core that other processes
leave free, with the same waits; "passive" adds OMP_WAIT_POLICY=PASSIVE (idle threads sleep
at once), which Glassformer leaves to the user because it slows a quiet machine. The busy
process is a Python loop spinning for a bounded time, started before the figure's process and
killed after it. Decode speed
excludes the prompt: (n - 1) / (time for n tokens - time for 1). With --repeats N each figure
is measured N times, quiet and busy alternating; prints the median tokens/s quiet and busy and
busy / quiet for each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

from glassformer.data import tinyshakespeare

HERE = Path(__file__).resolve().parent
DATA = tinyshakespeare()
MODEL = "smollm2-135m-instruct"
WORKLOADS = {"decode-fp32": "none", "decode-int4": "int4", "train": None}
SETTINGS = ("default", "threads", "passive")
SPIN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"


def decode_worker(quantize: str, tokens: int) -> float:
    from glassformer import load
    from glassformer.generation.generate import GenerationConfig, generate

    language_model = load(MODEL, quantize=quantize, progress=False)
    prompt = language_model.tokenizer.encode("The meaning of life is")

    def seconds(n: int) -> float:
        start = time.perf_counter()
        generate(language_model.model, prompt, GenerationConfig(max_new_tokens=n, eos_ids=()))
        return time.perf_counter() - start

    seconds(4)  # warm-up
    return (tokens - 1) / (seconds(tokens) - seconds(1))


def train_worker(iters: int, threads=None) -> float:
    from glassformer.training.config import get_recipe
    from glassformer.training.loop import train

    recipe = get_recipe("shakespeare-char")
    config = recipe.train.replace(max_iters=iters, eval_interval=10**6, eval_iters=1,
                                  sample_tokens=0, log_interval=iters, device="cpu")
    with tempfile.TemporaryDirectory() as out:
        result = train(DATA, Path(out) / "run", recipe.model, config, progress=False,
                       echo=lambda text: None, threads=threads)
    return result["tokens_per_second"]


def worker(workload: str, setting: str, tokens: int, iters: int) -> dict:
    import torch

    policy = None
    if setting != "default":
        from glassformer.accel.threads import ThreadPolicy

        policy = ThreadPolicy()

    rate = train_worker(iters, policy) if workload == "train" else decode_worker(WORKLOADS[workload], tokens)
    return {"tokens_per_second": rate, "threads": torch.get_num_threads(),
            "wait": "spin" if "GOMP_SPINCOUNT" in os.environ else os.environ["OMP_WAIT_POLICY"]}


def measure(workload: str, setting: str, busy: bool, args) -> dict:
    spinner = None
    if busy:
        spinner = subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=300)])
        time.sleep(0.5)
    try:
        command = [sys.executable, __file__, "--worker", workload, setting,
                   "--tokens", str(args.tokens), "--iters", str(args.iters)]
        env = {k: v for k, v in os.environ.items()
               if k not in ("OMP_NUM_THREADS", "GLASSFORMER_THREADS", "OMP_WAIT_POLICY",
                            "GOMP_SPINCOUNT")}
        if setting == "passive":
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        else:
            env["GOMP_SPINCOUNT"] = "300000"
        done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="decode: new tokens per figure")
    parser.add_argument("--iters", type=int, default=40, help="train: iterations per figure")
    parser.add_argument("--only", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    harness.add_arguments(parser, repeats=1)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.tokens, args.iters)))
        return
    record = harness.start("busy_cpu", args, json_mode=args.json)
    rows = []
    for workload in args.only:
        for setting in SETTINGS:
            runs = [[measure(workload, setting, b, args) for b in (False, True)] for _ in range(args.repeats)]
            rates = [harness.Timing(tuple(r[i]["tokens_per_second"] for r in runs)) for i in (0, 1)]
            quiet, busy = ({**runs[0][i], "tokens_per_second": rates[i].median} for i in (0, 1))
            row = {"workload": workload, "setting": setting, "quiet": quiet, "busy": busy,
                   "ratio": busy["tokens_per_second"] / quiet["tokens_per_second"]}
            rows.append(row)
            for i, state in enumerate(("quiet", "busy")):
                record.figure(f"{workload}, {setting}, {state}", rates[i], "tokens/s",
                              threads=runs[0][i]["threads"])
            record.ratio(f"{workload}, {setting}: busy / quiet", row["ratio"])
            if not args.json:
                print(f"{workload:12} {setting:8} quiet {quiet['tokens_per_second']:8.1f} tok/s "
                      f"({quiet['threads']} threads)  busy {busy['tokens_per_second']:8.1f} tok/s "
                      f"({busy['threads']} threads)  busy/quiet {row['ratio']:.2f}", flush=True)
    record.write()
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
