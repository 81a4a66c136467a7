"""Many requests at once on SmolLM2-135M-Instruct: Glassformer's engine (continuous batching over
a paged KV cache) vs Glassformer one request after another vs transformers' generate_batch.

Workloads:
  a  "The meaning of life is", 64 new tokens, greedy, once per client, all at once (the
     anchor; 8 requests for the systems other than the engine)
  b  32 prompts cut from tinyshakespeare (32-512 tokens), 16-128 new tokens, Poisson arrivals
  c  16 requests sharing a 512-token system prompt, 32 new tokens; plus the time to first
     token of one request alone on a cold cache and on a warm one (the prefix cached)
  d  capacity: a pool sized for 16 sequences of 2,048 tokens in int8, 16 short requests; and
     the accuracy cost of int8 keys and values: greedy tokens shared with an fp32 KV cache
The engine runs each workload at each number of clients (--clients): a client sends its next
request when its last one has finished (and, in b, once it has arrived), so at most that many
are in flight. For each: total tokens/s, time to first token (TTFT) p50/p95 (from the
moment its client sends it), time per output token (TPOT) p50/p95, the engine's tokens/s
against one client in the same mode, peak RSS (which counts loading the model) and resident
memory at the end. Every
run is its own subprocess (its own peak RSS); with --repeats N every run is made N times, the
rounds alternating between systems, and each figure is the median (min and max in the record).
transformers runs the same GGUF weights dequantized to float32 (a and c only: it takes one
setting for all).

    .venv/bin/python benchmarks/engine_throughput.py [--workloads a b c d] [--modes none int8 int4]
        [--clients 1 4 8 16] [--new-tokens N] [--skip sequential transformers] [--threads N]
        [--repeats 1] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness
from harness import peak_mb

from glassformer.data import tinyshakespeare

CORPUS = tinyshakespeare()  # --corpus
ANCHOR = "The meaning of life is"


def rss_mb() -> float:
    """Resident memory now (Linux): the peak above also counts loading the model."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def workload(name: str, encode, clients: int = 8) -> list[dict]:
    """Requests as {prompt ids, max_new_tokens, arrival seconds}; `clients` anchor requests in
    a (`ENGINE_BENCH_NEW_TOKENS` caps every request's new tokens: short trial runs)."""
    cap = int(os.environ.get("ENGINE_BENCH_NEW_TOKENS", "0")) or None
    return [r | {"n": min(r["n"], cap or r["n"])} for r in _requests(name, encode, clients)]


def _requests(name: str, encode, clients: int) -> list[dict]:
    rng = random.Random(0)
    if name == "a":
        return [{"ids": encode(ANCHOR), "n": 64, "at": 0.0} for _ in range(clients)]
    text = Path(os.environ.get("ENGINE_BENCH_CORPUS", CORPUS)).read_text(encoding="utf-8")
    ids = encode(text[:400_000])
    if name == "b":
        requests, t = [], 0.0
        for _ in range(32):
            length, start = rng.randint(32, 512), rng.randrange(len(ids) - 512)
            requests.append({"ids": ids[start : start + length], "n": rng.randint(16, 128), "at": t})
            t += rng.expovariate(2.0)  # 2 requests per second on average
        return requests
    system = ids[:512]
    if name == "c":
        return [{"ids": system + ids[1000 + 20 * i : 1012 + 20 * i], "n": 32, "at": 0.0} for i in range(16)]
    return [{"ids": ids[3000 + 40 * i : 3032 + 40 * i], "n": 64, "at": 0.0} for i in range(16)]


def summarize(records: list[dict], wall: float) -> dict:
    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    ttft = [r["first"] - r["at"] for r in records]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    return {"tokens_per_s": sum(r["tokens"] for r in records) / wall, "ttft_p50": pct(ttft, 0.5),
            "ttft_p95": pct(ttft, 0.95), "tpot_p50": pct(tpot, 0.5), "tpot_p95": pct(tpot, 0.95),
            "requests": len(records), "wall_s": wall}


def engine_worker(name: str, mode: str, clients: int) -> dict:
    from glassformer import load
    from glassformer.serving import Engine, EngineConfig, RequestParams

    lm = load("smollm2-135m-instruct", quantize=mode, progress=False)
    requests = workload(name, lm.tokenizer.encode, clients)
    config = EngineConfig(max_batch=max(16, clients), token_budget=256)
    if name == "d":  # 16 x 2,048 tokens of int8 keys and values, plus a block of slack
        config = EngineConfig(kv_dtype="int8", max_batch=16, n_blocks=16 * 2048 // 16 + 1)
    extra = {}
    if name == "d":  # before the big pool exists, so the peak RSS below is the engine's own
        extra["int8_kv_same_tokens"] = _kv_agreement(lm, requests)
    engine = Engine(lm.model, lm.tokenizer, config).start()
    try:
        warm = engine.submit(requests[0]["ids"][:8], RequestParams(max_new_tokens=2))
        warm.wait()  # the kernels and allocator warmed up
        if name == "c":  # one request alone, cold and then warm (its system prompt cached)
            for label, ids in (("cold", requests[0]["ids"]), ("warm", requests[1]["ids"])):
                start = time.perf_counter()
                handle = engine.submit(ids, RequestParams(max_new_tokens=1))
                handle.get()
                extra[f"ttft_{label}"] = time.perf_counter() - start
                handle.wait()
            extra["warm_over_cold"] = extra["ttft_warm"] / extra["ttft_cold"]
        records = asyncio.run(_drive(engine, requests, clients))
        wall = max(r["end"] for r in records) - min(r["at"] for r in records)
    finally:
        engine.close()
    stats = engine.stats
    return summarize(records, wall) | extra | {
        "peak_mb": peak_mb(), "rss_mb": rss_mb(), "pool_mb": engine.pool.nbytes() / 2**20,
        "preemptions": stats.preemptions, "prefix_hit_tokens": stats.prefix_hit_tokens,
        "tokens": [r["ids"] for r in records]}


def _kv_agreement(lm, requests) -> float:
    """The share of greedy tokens an int8 KV cache produces before it first departs from an
    fp32 one, over the requests."""
    from glassformer.serving import EngineConfig, RequestParams

    params = [RequestParams(max_new_tokens=r["n"], eos_ids=()) for r in requests]
    prompts = [r["ids"] for r in requests]
    fp32 = lm.generate_many(prompts, params=params, engine=EngineConfig(kv_memory_mb=64))
    int8 = lm.generate_many(prompts, params=params, engine=EngineConfig(kv_memory_mb=64, kv_dtype="int8"))
    same = total = 0
    for a, b in zip(fp32, int8, strict=True):
        total += len(a.generated_ids)
        same += next((i for i, (x, y) in enumerate(zip(a.generated_ids, b.generated_ids, strict=True))
                      if x != y), len(a.generated_ids))
    return same / total


async def _drive(engine, requests, clients: int) -> list[dict]:
    from glassformer.serving import RequestParams

    t0 = time.perf_counter()
    free = asyncio.Semaphore(clients)  # a client per request in flight

    async def one(request):
        await asyncio.sleep(max(0.0, t0 + request["at"] - time.perf_counter()))
        async with free:
            at = time.perf_counter()
            params = RequestParams(max_new_tokens=request["n"], eos_ids=())
            handle = engine.submit(request["ids"], params)
            first, ids = None, []
            async for event in handle:
                if event.token_id is not None:
                    first = first or time.perf_counter()
                    ids.append(event.token_id)
        return {"at": at, "first": first, "end": time.perf_counter(), "tokens": len(ids), "ids": ids}

    return await asyncio.gather(*(one(r) for r in requests))


def sequential_worker(name: str, mode: str, clients: int) -> dict:
    from glassformer import load
    from glassformer.generation.generate import GenerationConfig, stream

    lm = load("smollm2-135m-instruct", quantize=mode, progress=False)
    requests = workload(name, lm.tokenizer.encode)
    list(stream(lm.model, requests[0]["ids"][:8], GenerationConfig(max_new_tokens=2)))  # warm-up
    t0, records = time.perf_counter(), []
    for r in requests:  # one after another, each starting once it has arrived
        time.sleep(max(0.0, t0 + r["at"] - time.perf_counter()))
        first, ids = None, []
        for piece in stream(lm.model, r["ids"], GenerationConfig(max_new_tokens=r["n"], eos_ids=())):
            first = first or time.perf_counter()
            ids.append(piece.token_id)
        records.append({"at": t0 + r["at"], "first": first, "end": time.perf_counter(),
                        "tokens": len(ids), "ids": ids})
    wall = records[-1]["end"] - t0
    return summarize(records, wall) | {"peak_mb": peak_mb(), "tokens": [r["ids"] for r in records]}


def transformers_worker(name: str, mode: str, clients: int) -> dict:
    import torch
    import transformers

    from glassformer.formats import hub

    path = hub.model_path("smollm2-135m-instruct")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    requests = workload(name, lambda text: tokenizer.encode(text, add_special_tokens=False))
    config = transformers.GenerationConfig(max_new_tokens=requests[0]["n"], do_sample=False,
                                           eos_token_id=None)
    start = time.perf_counter()  # generate_batch runs its own thread: no inference_mode here
    out = model.generate_batch([r["ids"] for r in requests], generation_config=config)
    wall = time.perf_counter() - start
    failed = [o.error for o in out.values() if o.error]
    if failed:
        raise RuntimeError(f"generate_batch failed: {failed[0]}")
    tokens = [list(o.generated_tokens) for o in out.values()]
    return {"tokens_per_s": sum(map(len, tokens)) / wall, "wall_s": wall, "requests": len(tokens),
            "peak_mb": peak_mb(), "tokens": tokens}


SYSTEMS = {"engine": engine_worker, "sequential": sequential_worker, "transformers": transformers_worker}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["a", "b", "c", "d"], choices="abcd")
    parser.add_argument("--modes", nargs="+", default=["none", "int8", "int4"],
                        choices=["none", "bf16", "int8", "int4", "gguf"])
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4, 8, 16],
                        help="the engine's numbers of clients (requests in flight at most)")
    parser.add_argument("--new-tokens", type=int, default=0,
                        help="cap every request's new tokens (0: the workloads' own; short trials)")
    parser.add_argument("--skip", nargs="+", default=[], choices=["sequential", "transformers"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--corpus", default=str(CORPUS), help="tinyshakespeare.txt (workloads b, c, d)")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    harness.add_arguments(parser, repeats=1)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if min(args.clients) < 1 or args.new_tokens < 0:
        sys.exit("--clients must be at least 1 and --new-tokens at least 0")
    os.environ["ENGINE_BENCH_CORPUS"] = args.corpus  # read by the workers it starts
    os.environ["ENGINE_BENCH_NEW_TOKENS"] = str(args.new_tokens)
    if args.worker:
        system, name, mode, clients = args.worker
        print(json.dumps(SYSTEMS[system](name, mode, int(clients))))
        return
    record = harness.start("engine_throughput", args, json_mode=args.json)
    runs = []
    for name in args.workloads:
        for mode in args.modes:
            runs += [("engine", name, mode, clients) for clients in args.clients]
            if name in "ab" and "sequential" not in args.skip:
                runs.append(("sequential", name, mode, 8))
        if name in "ac" and "transformers" not in args.skip:
            runs.append(("transformers", name, "fp32", 8))
    rounds: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for system, name, mode, clients in runs:
            command = [sys.executable, __file__, "--worker", system, name, mode, str(clients),
                       "--corpus", args.corpus, "--new-tokens", str(args.new_tokens)]
            if args.threads:
                command += ["--threads", str(args.threads)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode:
                sys.exit(f"{system} {name} {mode} failed:\n{done.stderr[-2000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result.pop("tokens")
            key = f"{name} {system} {mode}" + (f" x{clients}" if system == "engine" else "")
            rounds.setdefault(key, []).append(result)
            if not args.json:
                shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
                print(f"{key:<22} {json.dumps(shown)}", flush=True)
    results = {}
    for key, values in rounds.items():  # each figure the median of its rounds
        results[key] = {k: statistics.median(r[k] for r in values) if isinstance(v, (int, float)) else v
                        for k, v in values[0].items()}
        for k, unit in (("tokens_per_s", "tokens/s"), ("ttft_p50", "s"), ("ttft_p95", "s"),
                        ("tpot_p50", "s"), ("tpot_p95", "s"), ("peak_mb", "MB")):
            if k in values[0]:
                record.figure(f"{key}, {k}", harness.Timing(tuple(r[k] for r in values)), unit)
    for key, result in results.items():
        name, system, mode = key.split()[:3]
        theirs = results.get(f"{name} transformers fp32")
        if system == "engine" and theirs:
            record.ratio(f"{key} / transformers tokens/s", result["tokens_per_s"] / theirs["tokens_per_s"])
        one_stream = results.get(f"{name} engine {mode} x1")
        if system == "engine" and one_stream and key != f"{name} engine {mode} x1":
            ratio = result["tokens_per_s"] / one_stream["tokens_per_s"]
            record.ratio(f"{key} / one stream tokens/s", ratio)
            if not args.json:
                print(f"{key:<22} {ratio:.2f}x one stream's tokens/s")
    record.write()
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
