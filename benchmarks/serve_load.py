"""`glassformer serve` under load over HTTP on loopback: 1 / 4 / 8 / 16 concurrent streaming
clients, and the same anchor requests through the engine alone (no HTTP) for comparison.

Workloads:
  anchor  "The meaning of life is", 64 new tokens, greedy (max(8, clients) requests)
  mixed   distinct tinyshakespeare passages of about 32-512 tokens, 64 new tokens, greedy
          (2 x clients requests, at least 8)
For each: total generated tokens/s, time to first token (TTFT) p50/p95, end-to-end latency
p50/p95, and the server process's peak and current resident memory (/proc); each row is the
median of --repeats rounds. At the anchor's 8 clients, each round is followed by one of the
same requests through the engine alone (built and warmed up once, on as many threads as the
server's engine: --threads, default the cores less one, as `glassformer serve` does), so
their ratio, round by round, is the cost of HTTP.

    .venv/bin/python benchmarks/serve_load.py [--model smollm2-135m-instruct] [--quantize none]
        [--clients 1 4 8 16] [--workloads anchor mixed] [--threads N] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness
import httpx

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
ANCHOR = "The meaning of life is"
NAME = "bench"


def requests_for(workload: str, clients: int) -> list[str]:
    if workload == "anchor":
        return [ANCHOR] * max(8, clients)
    rng, text = random.Random(clients), CORPUS.read_text(encoding="utf-8")
    prompts = []
    for _ in range(max(8, 2 * clients)):
        length = rng.randint(128, 2048)  # characters: about 32-512 tokens
        start = rng.randrange(len(text) - length)
        prompts.append(text[start : start + length])
    return prompts


async def one(http: httpx.AsyncClient, prompt: str) -> dict:
    body = {"model": NAME, "prompt": prompt, "max_tokens": 64, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, usage = time.perf_counter(), None, None
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "latency": end - start, "tokens": usage["completion_tokens"],
            "prompt_tokens": usage["prompt_tokens"]}


async def load(url: str, prompts: list[str], clients: int) -> dict:
    queue = list(enumerate(prompts))
    results = [None] * len(prompts)

    async def client():
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            while queue:
                i, prompt = queue.pop(0)
                results[i] = await one(http, prompt)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - start
    return {
        "requests": len(prompts),
        "tokens_per_second": sum(r["tokens"] for r in results) / wall,
        "ttft_p50": percentile([r["ttft"] for r in results], 0.5),
        "ttft_p95": percentile([r["ttft"] for r in results], 0.95),
        "latency_p50": percentile([r["latency"] for r in results], 0.5),
        "latency_p95": percentile([r["latency"] for r in results], 0.95),
        "prompt_tokens_mean": sum(r["prompt_tokens"] for r in results) / len(results),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def memory_mb(pid: int) -> dict:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    kb = {name: int(fields[name].split()[0]) for name in ("VmHWM", "VmRSS")}
    return {"peak_rss_mb": kb["VmHWM"] / 1024, "rss_mb": kb["VmRSS"] / 1024}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# One engine, built and warmed up before the clock starts, as the server's is; each line on
# its stdin runs the anchor requests once and answers with their tokens/s.
ENGINE_ALONE = """
import json, sys, time
import torch
import glassformer
from glassformer.serving import Engine, EngineConfig, RequestParams
torch.set_num_threads(int(sys.argv[3]))
lm = glassformer.load(sys.argv[1], quantize=sys.argv[2])
engine = Engine(lm.model, lm.tokenizer, EngineConfig())
params = RequestParams.from_fields(max_new_tokens=64, temperature=0.0)
def run(prompts):
    handles = [engine.submit(lm.encode(p), params) for p in prompts]
    engine.run_until_done()
    return [h.result for h in handles]
run(["warm up"] * 8)
print("ready", flush=True)
for _ in sys.stdin:
    start = time.perf_counter()
    results = run([{anchor!r}] * 8)
    wall = time.perf_counter() - start
    print(json.dumps({{"tokens_per_second": sum(r.n_generated for r in results) / wall}}), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--workloads", nargs="+", default=["anchor", "mixed"], choices=["anchor", "mixed"])
    parser.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1),
                        help="the engine's threads, in the server and alone")
    parser.add_argument("--json", action="store_true")
    harness.add_arguments(parser, repeats=3)
    args = parser.parse_args()
    record = harness.start("serve_load", args, json_mode=args.json)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-c", "from glassformer.cli import main; raise SystemExit(main())", "serve",
               "--model", args.model, "--quantize", args.quantize, "--name", NAME, "--port", str(port),
               "--max-queue", "256", "--threads", str(args.threads)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    alone = subprocess.Popen([sys.executable, "-c", ENGINE_ALONE.format(anchor=ANCHOR), args.model,
                              args.quantize, str(args.threads)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)

    def engine_alone() -> float:
        """One round of the anchor requests through the engine alone: tokens/s."""
        alone.stdin.write("go\n")
        alone.stdin.flush()
        return json.loads(alone.stdout.readline())["tokens_per_second"]

    rows = []
    try:
        if alone.stdout.readline().strip() != "ready":
            sys.exit("the engine alone did not start")
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                if server.poll() is not None:
                    sys.exit("the server did not start")
                time.sleep(0.5)
        asyncio.run(load(url, [ANCHOR], 1))  # warm up
        for workload in args.workloads:
            for clients in args.clients:
                # Repeated rounds; at the anchor's 8 clients each one is followed by a round of
                # the engine alone, so both see the same machine (the other process idles).
                rounds, alone_rounds = [], []
                for _ in range(args.repeats):
                    rounds.append(asyncio.run(load(url, requests_for(workload, clients), clients)))
                    if workload == "anchor" and clients == 8:
                        alone_rounds.append(engine_alone())
                measured = sorted(rounds, key=lambda r: r["tokens_per_second"])[len(rounds) // 2]
                row = {"workload": workload, "clients": clients, **measured, **memory_mb(server.pid),
                       "rounds_tokens_per_second": [r["tokens_per_second"] for r in rounds]}
                if alone_rounds:
                    row["engine_alone_tokens_per_second"] = statistics.median(alone_rounds)
                    row["http_cost"] = statistics.median(
                        1 - r["tokens_per_second"] / a for r, a in zip(rounds, alone_rounds, strict=True))
                rows.append(row)
                label = f"{workload}, {clients} clients"
                record.figure(f"{label}, tokens/s", harness.Timing(tuple(row["rounds_tokens_per_second"])),
                              "tokens/s")
                record.figure(f"{label}, TTFT p95 (median round)", row["ttft_p95"], "s")
                record.figure(f"{label}, server peak resident memory", row["peak_rss_mb"], "MB")
                if alone_rounds:
                    record.figure(f"{label}, engine alone", harness.Timing(tuple(alone_rounds)), "tokens/s")
                    record.ratio(f"{label}: HTTP cost (1 - server / engine alone, median of rounds)",
                                 row["http_cost"])
                if not args.json:
                    print(f"{workload:6} {clients:2} clients: {row['tokens_per_second']:6.1f} tok/s  "
                          f"TTFT p50 {row['ttft_p50']:.3f} p95 {row['ttft_p95']:.3f} s  "
                          f"latency p50 {row['latency_p50']:.2f} p95 {row['latency_p95']:.2f} s  "
                          f"RSS peak {row['peak_rss_mb']:.0f} now {row['rss_mb']:.0f} MB  (median of "
                          f"{', '.join(f'{r:.0f}' for r in row['rounds_tokens_per_second'])})",
                          flush=True)
                    if alone_rounds:
                        print(f"       engine alone: {row['engine_alone_tokens_per_second']:.1f} tok/s "
                              f"(rounds {', '.join(f'{a:.0f}' for a in alone_rounds)}); HTTP costs "
                              f"{row['http_cost']:.1%} (median of the rounds' ratios)", flush=True)
    finally:
        server.terminate()
        alone.terminate()
        server.wait(60)
        alone.wait(60)
    record.write()
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
