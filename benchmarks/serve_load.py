"""`glassformer serve` under load over HTTP on loopback: workloads at 1 / 4 / 8 / 16 concurrent
streaming clients, the cost of capture and the lens, and the cost of a served LoRA adapter, in
each weight mode (--modes: the servers' --quantize), side by side in one run.

Workloads (every request greedy with ignore_eos, so it generates exactly its new tokens; the
prompts are sent as token ids of the model's tokenizer):
  anchor  "The meaning of life is", 64 new tokens (max(8, clients) requests)
  mixed   16 distinct prompts of 32-512 tokens cut from tinyshakespeare, 16-128 new tokens each
  shared  16 requests: one 512-token system prompt and 12 tokens of their own, 32 new tokens
A client sends its next request when its last one has finished. The prompts' lengths and new
tokens are the same in every run, but each run cuts its prompts from its own places in the
text, so no run finds an earlier one's prompts in its server's prefix cache.

For each run: total generated tokens/s, time to first token (TTFT, from the moment its client
sends the request) p50/p95, time per output token (TPOT, first to last token) p50/p95,
end-to-end latency p50/p95, and the server's peak resident memory during the run (its
high-water mark is reset before the run through /proc/PID/clear_refs; the peak of loading is
reported once per server). Ratios:
  load     each run's tokens/s against one client (same mode and workload)
  alone    at each of the anchor's client counts, the server against the same requests through
           the engine alone in the same round (no HTTP; built and warmed up once, on the server
           engine's --threads; c requests in flight at a time, as c clients keep them)
  llama    at each of the anchor's client counts, the server against `llama-server -np c` on
           the model's GGUF file, in the same round (its own binary: --llama-cpp DIR or
           $LLAMA_CPP_DIR, see benchmarks/llama_binaries.py; without it these rows are left out)
  inspect  the anchor workload at --compare-clients on three servers of the same mode: off (a
           server started with --max-capture-mb 0: no trace or lens), none (capture on, no
           request asks), half (every other request asks for the trace of blocks.0.attn.out
           and blocks.0.resid_post and the lens, top 5, of every layer), layers (the same
           requests with the lens of every 8th layer and the last only): none / off,
           half / off and layers / off
  adapter  the anchor workload at --compare-clients on a server started with --lora: a rank-16
           adapter on every linear layer (made at start, B random as a trained one's): half
           (every other request names it in `model`) / base (no request names it)
The servers of a mode stay up side by side (idle when not measured); every round runs each
configuration once, in turn, so a change in the machine's load falls on all of them; with
--repeats N each figure is the median of its N rounds (min and max in the record) and each
ratio the median of the rounds' ratios. The CPU line comes first (benchmarks/harness.py).

    python benchmarks/serve_load.py      # int4: the three workloads, inspect, adapter; 3 rounds
    python benchmarks/serve_load.py --modes none int8 int4 gguf --inspect --adapter
    python benchmarks/serve_load.py --workloads --inspect off none half layers --adapter --repeats 5
    python benchmarks/serve_load.py --workloads --inspect --adapter base half --repeats 5
        [--model smollm2-135m-instruct] [--clients 1 4 8 16] [--compare-clients 8]
        [--threads N] [--new-tokens N] [--corpus PATH] [--llama-cpp DIR] [--json]

(`--workloads`, `--inspect` or `--adapter` with no values leaves that part out.)
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import harness
import httpx
import llama_binaries
from finetune import served_adapter

from glassformer import load
from glassformer.data import tinyshakespeare

CORPUS = tinyshakespeare()  # --corpus
ANCHOR = "The meaning of life is"
NAME, ADAPTER = "bench", "bench-lora"
SITES = ("blocks.0.attn.out", "blocks.0.resid_post")  # what an inspecting request traces
INSPECT = {"trace": list(SITES), "lens": {"top_k": 5}}
LENS_EVERY = 8  # inspect "layers": the lens of every 8th residual and the last
WORKLOADS = ("anchor", "mixed", "shared")
TEXT = re.compile(rb'"text": ?"(?!")')  # a chunk with text (in a completion's stream)


@dataclass(frozen=True)
class Run:
    """One configuration, measured once per round: a workload at a number of clients on one of
    the mode's servers ("base"; "off": --max-capture-mb 0; "lora": --lora), with every other
    request inspecting or on the adapter (`half`)."""

    label: str
    workload: str
    clients: int
    server: str = "base"
    half: str | None = None  # "inspect", "inspect-layers" or "adapter"


def plan(args: argparse.Namespace, mode: str) -> list[Run]:
    runs = [Run(f"{mode} {w} x{c}", w, c) for w in args.workloads for c in args.clients]
    for c in args.compare_clients:
        runs += [Run(f"{mode} anchor x{c} inspect {v}", "anchor", c, "off" if v == "off" else "base",
                     {"half": "inspect", "layers": "inspect-layers"}.get(v)) for v in args.inspect]
        runs += [Run(f"{mode} anchor x{c} adapter {v}", "anchor", c, "lora",
                     "adapter" if v == "half" else None) for v in args.adapter]
    return runs


def requests_for(workload: str, clients: int, ids: list[int], anchor: list[int], seed: int,
                 cap: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) of each request: the lengths and new tokens are the workload's
    own; where the prompts are cut from `ids` depends on `seed` (`cap`: at most that many new
    tokens each, for short trials)."""
    cuts = random.Random(seed)
    if workload == "anchor":
        requests = [(anchor, 64)] * max(8, clients)
    elif workload == "mixed":
        shape, requests = random.Random(0), []
        for _ in range(16):
            length, new = shape.randint(32, 512), shape.randint(16, 128)
            start = cuts.randrange(len(ids) - length)
            requests.append((ids[start : start + length], new))
    else:
        start = cuts.randrange(len(ids) - 512)
        system = ids[start : start + 512]
        own = [cuts.randrange(len(ids) - 12) for _ in range(16)]
        requests = [(system + ids[o : o + 12], 32) for o in own]
    return [(prompt, min(new, cap or new)) for prompt, new in requests]


def inspecting(n_layers: int) -> dict[str, dict]:
    """What an inspecting request asks under `glassformer`, by its run's `half`."""
    layers = sorted({*range(0, n_layers + 1, LENS_EVERY), n_layers})
    return {"inspect": INSPECT, "inspect-layers": INSPECT | {"lens": {"top_k": 5, "layers": layers}}}


def llama_body(prompt: list[int], new: int) -> dict:
    """The same request for llama-server (its own name for ignore_eos)."""
    return {"prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


def body(prompt: list[int], new: int, inspect: dict | None = None, adapter: bool = False) -> dict:
    return {"model": ADAPTER if adapter else NAME, "prompt": prompt, "max_tokens": new, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "glassformer": {"ignore_eos": True, **(inspect or {})}}


async def one(url: str, request: dict) -> dict:
    """One streamed request: its times, and whether its last chunk brought the trace and lens.
    The client shares the cores with the server, so it parses next to nothing while the stream
    runs: one HTTP/1.1 request on its own connection, the reply's bytes kept with the time each
    read arrived; the events are parsed once the stream has ended."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(request).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(data), data))
    reads = []  # (time, bytes) of each read, chunked framing and all
    while piece := await reader.read(1 << 16):
        reads.append((time.perf_counter(), piece))
    end = time.perf_counter()
    writer.close()
    head, _, raw = b"".join(piece for _, piece in reads).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the server answered {head[:300]!r}: {raw[:300]!r}")
    events = [json.loads(line[6:]) for line in unchunked(raw).split(b"\n\n") if line.startswith(b"data: {")]
    if any("error" in event for event in events):
        raise RuntimeError(f"the stream ended with an error: {events[-1].get('error')}")
    texts = [m.start() for m in TEXT.finditer(b"".join(piece for _, piece in reads))]
    times, edges, seen = [], [], 0  # the arrival time of each text chunk, by its byte offset
    for when, piece in reads:
        seen += len(piece)
        edges.append(seen)
        times.append(when)
    first = times[bisect.bisect_right(edges, texts[0])] if texts else None
    last = times[bisect.bisect_right(edges, texts[-1])] if texts else None
    finish = next((e for e in events if e["choices"] and e["choices"][0].get("finish_reason")), {})
    extra = finish.get("glassformer", {})
    usage = next((e["usage"] for e in reversed(events) if e.get("usage")), None)
    tokens = usage["completion_tokens"] if usage else len(texts)  # (llama-server without usage)
    if tokens != request["max_tokens"]:
        raise RuntimeError(f"a request generated {tokens} tokens, not {request['max_tokens']}")
    return {"ttft": (first or end) - start, "latency": end - start, "tokens": tokens,
            "tpot": (last - first) / (tokens - 1) if first and tokens > 1 else None,
            "inspected": set(extra.get("trace", {})) == set(SITES) and "lens" in extra}


def unchunked(raw: bytes) -> bytes:
    """The body of a reply in HTTP/1.1's chunked transfer encoding."""
    body, at = bytearray(), 0
    while True:
        line_end = raw.index(b"\r\n", at)
        size = int(raw[at:line_end].split(b";")[0], 16)
        if size == 0:
            return bytes(body)
        body += raw[line_end + 2 : line_end + 2 + size]
        at = line_end + 2 + size + 2


async def drive(url: str, requests: list[dict], clients: int) -> dict:
    """`requests` from `clients` concurrent clients, each sending its next when its last ended;
    with the CPU seconds this client took (per generated token)."""
    queue, results = list(enumerate(requests)), [None] * len(requests)

    async def client() -> None:
        while queue:
            i, request = queue.pop(0)
            results[i] = await asyncio.wait_for(one(url, request), 600)

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    inspecting = ["trace" in r.get("glassformer", {}) for r in requests]
    if [r["inspected"] for r in results] != inspecting:
        raise RuntimeError("the trace and lens came back for other requests than those that asked")
    return {"tokens_per_second": sum(r["tokens"] for r in results) / wall, "wall_s": wall,
            "ttft_p50": percentile([r["ttft"] for r in results], 0.5),
            "ttft_p95": percentile([r["ttft"] for r in results], 0.95),
            "tpot_p50": percentile(tpot, 0.5), "tpot_p95": percentile(tpot, 0.95),
            "latency_p50": percentile([r["latency"] for r in results], 0.5),
            "latency_p95": percentile([r["latency"] for r in results], 0.95),
            "requests": len(results), "tokens": sum(r["tokens"] for r in results),
            "inspected": sum(inspecting), "adapted": sum(r.get("model") == ADAPTER for r in requests),
            "client_cpu_s_per_token": cpu / sum(r["tokens"] for r in results)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Served:
    """`glassformer serve` in its own process on a free loopback port, its output in `log`."""

    def __init__(self, args: argparse.Namespace, mode: str, flags: list[str], log: Path) -> None:
        self.url, self.log = f"http://127.0.0.1:{llama_binaries.free_port()}", log
        command = [sys.executable, "-c", "from glassformer.cli import main; raise SystemExit(main())",
                   "serve", "--model", args.model, "--quantize", mode, "--name", NAME,
                   "--port", self.url.split(":")[-1], "--max-queue", "256", "--threads", str(args.threads),
                   *flags]
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600) -> None:
        llama_binaries.wait_healthy(self.url, self.process, self.log, timeout, "the server")

    def memory_mb(self) -> dict:
        """The peak resident memory since the last reset (or the start), and now."""
        status = Path(f"/proc/{self.process.pid}/status").read_text().splitlines()
        kb = {name: int(value.split()[0]) for name, value in (line.split(":", 1) for line in status)
              if name in ("VmHWM", "VmRSS")}
        return {"peak_rss_mb": kb["VmHWM"] / 1024, "rss_mb": kb["VmRSS"] / 1024}

    def reset_peak(self) -> None:
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


# One engine, built and warmed up before the clock starts, as the server's is; each line on
# its stdin, a number of clients c, runs the anchor workload's max(8, c) requests once, c at a
# time (as c clients keep c in flight: the requests are alike, so they end together), and
# answers with their tokens/s.
ENGINE_ALONE = """
import json, sys, time
import torch
import glassformer
from glassformer.serving import Engine, EngineConfig, RequestParams
model, mode, threads, anchor, new = sys.argv[1:]
anchor = json.loads(anchor)
torch.set_num_threads(int(threads))
lm = glassformer.load(model, quantize=mode)
engine = Engine(lm.model, lm.tokenizer, EngineConfig())
params = RequestParams.from_fields(max_new_tokens=int(new), temperature=0.0, eos_ids=())
def run(clients):
    results = []
    for wave in range(0, max(8, clients), clients):
        handles = [engine.submit(anchor, params) for _ in range(min(clients, max(8, clients) - wave))]
        engine.run_until_done()
        results += [h.result for h in handles]
    return results
run(8)
print("ready", flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    results = run(int(line))
    wall = time.perf_counter() - start
    print(json.dumps({"tokens_per_second": sum(r.n_generated for r in results) / wall}), flush=True)
"""


class EngineAlone:
    """The anchor requests through the engine alone, in its own process."""

    def __init__(self, args: argparse.Namespace, mode: str, anchor: list[int]) -> None:
        new = min(64, args.new_tokens or 64)
        command = [sys.executable, "-c", ENGINE_ALONE, args.model, mode, str(args.threads),
                   json.dumps(anchor), str(new)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def wait_ready(self) -> None:
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError("the engine alone did not start")

    def round(self, clients: int) -> float:
        self.process.stdin.write(f"{clients}\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())["tokens_per_second"]


class Beside:
    """What an anchor load run at c clients is compared with in the same round: the engine alone
    (always) and `llama-server -np c` (where its binary and a GGUF file are at hand)."""

    def __init__(self, args: argparse.Namespace, mode: str, anchor: list[int], folder: Path,
                 processes: list[subprocess.Popen]) -> None:
        self.anchor, self.new = anchor, min(64, args.new_tokens or 64)
        self.alone = EngineAlone(args, mode, anchor)
        processes.append(self.alone.process)
        self.llama: dict[int, llama_binaries.LlamaServer] = {}
        server = llama_binaries.find(args.llama_cpp, "llama-server")
        model = None if server is None else llama_binaries.gguf_file(args.model)
        if model is not None:
            for c in args.clients:
                self.llama[c] = llama_binaries.LlamaServer(server, model, args.threads, c, 1024,
                                                      folder / f"llama-server-{c}.log")
                processes.append(self.llama[c].process)

    def wait_ready(self) -> None:
        self.alone.wait_ready()
        for server in self.llama.values():
            server.wait_ready()
            asyncio.run(drive(server.url, [llama_body(self.anchor, 8)], 1))

    def round(self, clients: int) -> dict[str, float]:
        """tokens/s of each contender on the anchor requests at `clients`."""
        side = {"engine alone": self.alone.round(clients)}
        if clients in self.llama:
            requests = [llama_body(self.anchor, self.new)] * max(8, clients)
            side[f"llama-server -np {clients}"] = asyncio.run(
                drive(self.llama[clients].url, requests, clients))["tokens_per_second"]
        return side


def stop(processes: list[subprocess.Popen]) -> None:
    """All at once: each server takes a moment to shut down."""
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(60)


def start(args: argparse.Namespace, mode: str, runs: list[Run], anchor: list[int], folder: Path,
          record: harness.Record, processes: list[subprocess.Popen]
          ) -> tuple[dict[str, Served], Beside | None]:
    """The mode's servers, up and warmed up (each path the runs take: plain, inspecting, on the
    adapter), and what the anchor load runs are compared with, if there are any; their
    processes in `processes`."""
    flags = {"base": [], "off": ["--max-capture-mb", "0"],
             "lora": ["--lora", f"{ADAPTER}={folder / 'adapter'}"]}
    servers = {}
    for name in dict.fromkeys(run.server for run in runs):
        servers[name] = Served(args, mode, flags[name], folder / f"{mode}-{name}.log")
        processes.append(servers[name].process)
    beside = Beside(args, mode, anchor, folder, processes) if any(map(compared, runs)) else None
    for name, server in servers.items():
        server.wait_ready()
        record.figure(f"{mode} server {name}: peak resident memory after loading",
                      server.memory_mb()["peak_rss_mb"], "MB")
        warm = [body(anchor, 8), *([body(anchor, 8, inspect=INSPECT)] if name == "base" else []),
                *([body(anchor, 8, adapter=True)] if name == "lora" else [])]
        asyncio.run(drive(server.url, warm, 1))
    if "off" in servers:  # the baseline must refuse what the others serve
        refused = body(anchor, 1, inspect=INSPECT) | {"stream": False, "stream_options": None}
        status = httpx.post(f"{servers['off'].url}/v1/completions", json=refused, timeout=60).status_code
        if status != 400:
            raise RuntimeError(f"--max-capture-mb 0 answered an inspecting request with {status}, not 400")
    if beside is not None:
        beside.wait_ready()
    return servers, beside


def compared(run: Run) -> bool:
    """Whether a run is an anchor load run, compared with the engine alone and llama-server."""
    return run.workload == "anchor" and run.label.endswith(f"anchor x{run.clients}")


def measure(args: argparse.Namespace, mode: str, ids: list[int], anchor: list[int], folder: Path,
            record: harness.Record, inspects: dict[str, dict]) -> list[dict]:
    """Every run of one mode, in rounds: its rows; its figures and ratios in `record`."""
    runs = plan(args, mode)
    rounds: dict[str, list[dict]] = {run.label: [] for run in runs}
    sides: dict[str, dict[str, list[float]]] = {}  # run label -> contender -> tokens/s by round
    processes: list[subprocess.Popen] = []
    try:
        servers, beside = start(args, mode, runs, anchor, folder, record, processes)
        for r in range(args.repeats):
            for i, run in enumerate(runs):
                cut = requests_for(run.workload, run.clients, ids, anchor, 1000 * r + i, args.new_tokens)
                requests = [body(prompt, new, inspect=inspects.get(run.half) if j % 2 == 1 else None,
                                 adapter=run.half == "adapter" and j % 2 == 1)
                            for j, (prompt, new) in enumerate(cut)]
                server = servers[run.server]
                server.reset_peak()
                result = asyncio.run(drive(server.url, requests, run.clients)) | server.memory_mb()
                rounds[run.label].append(result)
                if not args.json:
                    print(f"round {r + 1} {run.label:<28} {result['tokens_per_second']:7.1f} tok/s  TTFT p50 "
                          f"{result['ttft_p50']:.3f} p95 {result['ttft_p95']:.3f} s  TPOT p50 "
                          f"{1e3 * result['tpot_p50']:.1f} ms  peak RSS {result['peak_rss_mb']:.0f} MB  "
                          f"client {1e3 * result['client_cpu_s_per_token']:.3f} CPU ms/token", flush=True)
                if beside is None or not compared(run):
                    continue
                for name, tps in beside.round(run.clients).items():
                    sides.setdefault(run.label, {}).setdefault(name, []).append(tps)
                    if not args.json:
                        print(f"round {r + 1} {run.label + ', ' + name:<28} {tps:7.1f} tok/s  "
                              f"server / it {result['tokens_per_second'] / tps:.3f}", flush=True)
    finally:
        stop(processes)
    for label, contenders in sides.items():
        for name, values in contenders.items():
            record.figure(f"{label}, {name}, tokens/s", harness.Timing(tuple(values)), "tokens/s")
            record.ratio(f"{label}: server / {name} tokens/s", statistics.median(
                v["tokens_per_second"] / a for v, a in zip(rounds[label], values, strict=True)))
    return report(args, mode, runs, rounds, record)


def report(args: argparse.Namespace, mode: str, runs: list[Run], rounds: dict[str, list[dict]],
           record: harness.Record) -> list[dict]:
    """Each run's row (the median of its rounds, key by key) and figures; the ratios."""
    rows = []
    for run in runs:
        values = rounds[run.label]
        row = {"label": run.label, "mode": mode, "workload": run.workload, "clients": run.clients,
               "server": run.server, "half": run.half,
               **{k: statistics.median(v[k] for v in values) for k in values[0]},
               "rounds_tokens_per_second": [v["tokens_per_second"] for v in values]}
        rows.append(row)
        record.figure(f"{run.label}, tokens/s", harness.Timing(tuple(row["rounds_tokens_per_second"])),
                      "tokens/s")
        for key, unit in (("ttft_p50", "s"), ("ttft_p95", "s"), ("tpot_p50", "s"), ("tpot_p95", "s"),
                          ("peak_rss_mb", "MB"), ("client_cpu_s_per_token", "s")):
            record.figure(f"{run.label}, {key}", harness.Timing(tuple(v[key] for v in values)), unit)
    ratios = {}
    for run in runs:
        if run.label == f"{mode} {run.workload} x{run.clients}" and run.clients != 1:  # a load run
            ratios[f"{run.label} / x1 tokens/s"] = (run.label, f"{mode} {run.workload} x1")
    for c in args.compare_clients:
        base = f"{mode} anchor x{c}"
        for over in ("none", "half", "layers"):
            ratios[f"{base} inspect {over} / off tokens/s"] = (f"{base} inspect {over}",
                                                               f"{base} inspect off")
        ratios[f"{base} adapter half / base tokens/s"] = (f"{base} adapter half", f"{base} adapter base")
    for name, (top, bottom) in ratios.items():
        if top in rounds and bottom in rounds:
            record.ratio(name, round_ratio(rounds[top], rounds[bottom]))
    return rows


def round_ratio(top: list[dict], bottom: list[dict]) -> float:
    """The median over rounds of one run's tokens/s over another's in the same round."""
    return statistics.median(a["tokens_per_second"] / b["tokens_per_second"]
                             for a, b in zip(top, bottom, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--modes", nargs="+", default=["int4"],
                        choices=["none", "bf16", "int8", "int4", "gguf"],
                        help="the servers' --quantize, one after another (default int4)")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS,
                        help="the load runs' workloads (none: no load runs)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16],
                        help="the load runs' concurrent clients")
    parser.add_argument("--inspect", nargs="*", default=["off", "none", "half", "layers"],
                        choices=["off", "none", "half", "layers"],
                        help="the capture and lens configurations compared (none given: no comparison)")
    parser.add_argument("--adapter", nargs="*", default=["base", "half"], choices=["base", "half"],
                        help="the served-adapter configurations compared (none given: no comparison)")
    parser.add_argument("--compare-clients", type=int, nargs="+", default=[8],
                        help="the clients of the inspect and adapter comparisons (anchor workload)")
    parser.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1),
                        help="the engine's threads, in the servers and alone (default: the cores less one)")
    parser.add_argument("--new-tokens", type=int, default=0,
                        help="cap every request's new tokens (0: the workloads' own; short trials)")
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="tinyshakespeare.txt (mixed, shared)")
    llama_binaries.add_argument(parser)
    parser.add_argument("--json", action="store_true")
    harness.add_arguments(parser, repeats=3)
    args = parser.parse_args()
    if min(args.clients + args.compare_clients) < 1 or args.new_tokens < 0 or args.repeats < 1:
        sys.exit("--clients, --compare-clients and --repeats must be at least 1, --new-tokens at least 0")
    record = harness.start("serve_load", args, json_mode=args.json)
    language_model = load(args.model, progress=False)  # its tokenizer cuts the prompts
    encode = language_model.tokenizer.encode
    ids, anchor = encode(args.corpus.read_text(encoding="utf-8")[:400_000]), encode(ANCHOR)
    inspects = inspecting(language_model.config.n_layers)
    rows = []
    with tempfile.TemporaryDirectory(prefix="glassformer-serve-load-") as folder:
        if args.adapter:
            (Path(folder) / "adapter").mkdir()
            served_adapter(language_model, args.model, Path(folder) / "adapter")
        del language_model
        try:
            for mode in args.modes:
                rows += measure(args, mode, ids, anchor, Path(folder), record, inspects)
        except RuntimeError as error:
            sys.exit(f"serve_load: {error}")
    record.write()
    if args.json:
        print(json.dumps({"runs": rows, "ratios": record.ratios}, indent=1))
        return
    for name, value in record.ratios.items():
        print(f"{name:<52} {value:.3f}")


if __name__ == "__main__":
    main()
