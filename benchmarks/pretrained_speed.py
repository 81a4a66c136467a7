"""SmolLM2-135M-Instruct (Q4_1 GGUF): Glassformer vs transformers (which dequantizes to fp32).

Glassformer runs once per weight mode of `glassformer.load(path, quantize=...)`: `reference`
(plain nn.Linear modules, the readable path), `fp32` (the same float32 weights through the
decode kernels and the fused C++ step), `bf16`, `int8`, `int4` (converted once) and `gguf` (the
file's Q4_1 / Q8_0 blocks as they are). Each run is its own subprocess, so load time and peak
memory (ru_maxrss) are its own: load the GGUF; greedy 128 tokens after "The meaning of life
is"; one 512-token prefill. Peak resident memory is read after the load, after the load and
the 128-token generations (what a user of `generate` holds), and at the end (the prefill
too). Decode speed excludes the prompt: (128 - 1) / (time for 128 tokens - time for 1), over
--repeats rounds (median, min and max). Prefill is what generation does with a prompt: every
position through the model, the head on the last one only (transformers:
logits_to_keep=1). Load is reported as wall time and as CPU time (user + system), which a busy
machine inflates less. llama.cpp runs the same file through llama-cpp-python when that package
is installed (`pip install llama-cpp-python`, which builds llama.cpp for this CPU); it is not a
dependency of Glassformer, and without it the llama.cpp row is left out. llama.cpp's own
`llama-bench` (tg128, no prompt) runs before and after the other rows where its folder is given
(--llama-cpp DIR or $LLAMA_CPP_DIR, benchmarks/llama_binaries.py).

The Q4_K_M row: the same model as most GGUF files are published, made by llama.cpp's own
tools where its folder is given: the Q4_1 file exported to a Hugging Face folder (`glassformer
export`, float32), converted to f16 by llama.cpp's `convert_hf_to_gguf.py` and quantized by
`llama-quantize` to Q4_K_M (made once, under <home>/benchmarks/); `glassformer gguf Q4_K_M`
decodes it with its K-quant blocks kept, and llama-bench runs on the same file beside it.

The roofline: a decode token reads every product's weights once (in their stored format: the
fp32, bf16, int8 / int4 or GGUF blocks, each tensor once; the token table's one row, the norms
and the KV cache left out), so the machine's read bandwidth (`torch.sum` over 1 GiB on the same
threads, in its own process before and after the runs, the higher of the two: a busy moment
only lowers it) over those bytes is the most tokens/s it allows; each mode's decode rate is
given as a fraction of it.

    .venv/bin/python benchmarks/pretrained_speed.py [--threads N] [--repeats 2] [--json] [--only NAME ...]
        [--llama-cpp DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import harness
import llama_binaries
from harness import peak_mb

PROMPT = "The meaning of life is"
NEW_TOKENS = 128
PREFILL = 512


def glassformer_worker(path: str, mode: str, repeats: int) -> dict:
    from glassformer import load
    from glassformer.generation.core import prefill
    from glassformer.generation.generate import GenerationConfig, generate

    start, cpu = time.perf_counter(), time.process_time()
    language_model = load(path, quantize=None if mode == "reference" else mode, progress=False)
    model, tokenizer = language_model.model, language_model.tokenizer
    load_s, load_peak = time.perf_counter() - start, peak_mb()
    load_cpu = time.process_time() - cpu
    prompt = tokenizer.encode(PROMPT)

    def run(n: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        result = generate(model, prompt, GenerationConfig(max_new_tokens=n, eos_ids=()))
        return time.perf_counter() - start, result.generated_ids

    return _measure(load_s, load_cpu, load_peak, run, lambda ids: prefill(model, ids),
                    tokenizer.encode, repeats) | {"weight_bytes": weight_bytes(model)}


def weight_bytes(model) -> int:
    """The bytes of weights one decode token reads: each product's parameters and buffers in
    their stored format, each tensor once (a tied head shares the token table)."""
    tensors = {t.data_ptr(): t for layer in model.linear_layers().values()
               for t in [*layer.parameters(), *layer.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second `torch.sum` reads over 1 GiB of float32, median of `repeats`."""
    import statistics

    import torch

    data = torch.ones(1 << 28)  # (2^28,) float32: 1 GiB
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times)


def transformers_worker(path: str, weights: str, repeats: int) -> dict:
    from pathlib import Path

    import torch
    import transformers

    path = Path(path)
    start, cpu = time.perf_counter(), time.process_time()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    load_s, load_peak = time.perf_counter() - start, peak_mb()
    load_cpu = time.process_time() - cpu
    ids = torch.tensor([tokenizer.encode(PROMPT, add_special_tokens=False)])

    def run(n: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n)
        return time.perf_counter() - start, out[0, ids.shape[1]:].tolist()

    return _measure(load_s, load_cpu, load_peak, run, lambda x: model(x, logits_to_keep=1).logits,
                    lambda text: tokenizer.encode(text, add_special_tokens=False), repeats)


def llama_cpp_worker(path: str, weights: str, repeats: int) -> dict:
    import os

    import torch
    from llama_cpp import Llama

    start, cpu = time.perf_counter(), time.process_time()
    llm = Llama(model_path=path, n_ctx=2 * PREFILL, n_batch=PREFILL, verbose=False,
                n_threads=torch.get_num_threads() or os.cpu_count())
    load_s, load_peak = time.perf_counter() - start, peak_mb()
    load_cpu = time.process_time() - cpu

    def encode(text: str) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=False, special=False)

    prompt = encode(PROMPT)

    def run(n: int) -> tuple[float, list[int]]:
        start, tokens = time.perf_counter(), []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # greedy
            tokens.append(token)
            if len(tokens) == n:
                break
        return time.perf_counter() - start, tokens

    def forward(ids) -> None:
        llm.reset()
        llm.eval(ids[0].tolist())

    return _measure(load_s, load_cpu, load_peak, run, forward, encode, repeats)


def _measure(load_s, load_cpu, load_peak, run, forward, encode, repeats: int) -> dict:
    """Decode and prefill rates, `repeats` samples each."""
    import torch

    with torch.inference_mode():
        run(4)  # warm-up
        decode = []
        for _ in range(repeats):
            one, _ = run(1)
            full, tokens = run(NEW_TOKENS)
            decode.append((NEW_TOKENS - 1) / (full - one))
        decode_peak = peak_mb()  # load + 128 tokens
        ids = torch.tensor([(encode(PROMPT + " ") * PREFILL)[:PREFILL]])
        forward(ids[:, :64])  # warm-up
        prefill = []
        for _ in range(repeats):
            start = time.perf_counter()
            forward(ids)
            prefill.append(PREFILL / (time.perf_counter() - start))
    return {"load_s": load_s, "load_cpu_s": load_cpu, "load_peak_mb": load_peak,
            "decode_peak_mb": decode_peak, "peak_mb": peak_mb(),
            "decode_tok_s": decode, "prefill_tok_s": prefill, "tokens": tokens,
            "threads": torch.get_num_threads()}


RUNS = {**{f"glassformer {mode}": (glassformer_worker, mode)
           for mode in ("reference", "none", "bf16", "int8", "int4", "gguf")},
        "glassformer gguf Q4_K_M": (glassformer_worker, "gguf"),  # the Q4_K_M file, where made
        "transformers": (transformers_worker, "fp32"),
        "llama.cpp": (llama_cpp_worker, "gguf")}


def q4_k_m_file(model: Path, binaries: Path | None) -> Path | None:
    """SmolLM2 in Q4_K_M made by llama.cpp's tools from `model` (see the top), once; None (with
    a line saying why) where llama.cpp's folder is not given."""
    from glassformer.home import home

    source = llama_binaries.source_folder(binaries) if binaries is not None else None
    if source is None:
        print("no llama.cpp build and source: the Q4_K_M row is left out", file=sys.stderr)
        return None
    folder = home() / "benchmarks" / "smollm2-135m-instruct"
    quantized = folder.with_name(folder.name + ".Q4_K_M.gguf")
    if quantized.is_file():
        return quantized
    if not (folder / "config.json").is_file():
        llama_binaries.run([sys.executable, "-m", "glassformer", "export", "--model", str(model),
                            "--to", "hf", "--output", str(folder)])
    f16 = llama_binaries.convert_hf(source, folder, folder.with_name(folder.name + ".f16.gguf"), "f16")
    partial = quantized.with_suffix(".partial")
    llama_binaries.quantize(binaries, f16, partial, "Q4_K_M")
    partial.rename(quantized)
    return quantized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", action="store_true")
    modes = [n.split()[-1] for n in RUNS if n.startswith("glassformer")]
    parser.add_argument("--only", nargs="+", choices=modes,
                        help="glassformer modes to run (transformers always runs, and llama.cpp "
                             "where llama-cpp-python is installed)")
    llama_binaries.add_argument(parser)
    parser.add_argument("--worker", choices=[*RUNS, "bandwidth"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    harness.add_arguments(parser, repeats=2)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.worker == "bandwidth":  # in its own process: its 1 GiB stays out of the others' peaks
        print(json.dumps(read_bandwidth()))
        return
    if args.worker:
        worker, weights = RUNS[args.worker]
        print(json.dumps(worker(args.path, weights, args.repeats)))
        return
    record = harness.start("pretrained_speed", args, json_mode=args.json)
    from glassformer.formats import hub

    path = str(hub.model_path("smollm2-135m-instruct"))
    import torch

    threads = args.threads or torch.get_num_threads()
    bench = llama_binaries.find(args.llama_cpp, "llama-bench")
    k_quants = q4_k_m_file(Path(path), bench.parent if bench is not None else None)
    files = {name: path for name in RUNS} | {"glassformer gguf Q4_K_M": k_quants and str(k_quants)}
    def read_bandwidth_alone() -> float:
        command = [sys.executable, __file__, "--worker", "bandwidth", "--threads", str(threads)]
        return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)

    bandwidth, bench_rates, bench_k_rates = [read_bandwidth_alone()], [], []

    def llama_bench() -> None:
        if bench is not None:
            bench_rates.extend(llama_binaries.bench_decode(bench, path, threads, NEW_TOKENS, args.repeats))
        if k_quants is not None:
            bench_k_rates.extend(llama_binaries.bench_decode(bench, k_quants, threads, NEW_TOKENS,
                                                             args.repeats))

    llama_bench()
    results = {}
    for name in RUNS:
        if args.only and name.startswith("glassformer") and name.split()[-1] not in args.only:
            continue
        if name == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
            print("llama-cpp-python is not installed: the llama.cpp row is left out")
            continue
        if files[name] is None:
            continue
        command = [sys.executable, __file__, "--worker", name, "--path", files[name],
                   "--repeats", str(args.repeats)]
        if args.threads:
            command += ["--threads", str(args.threads)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            sys.exit(f"{name} failed:\n{done.stderr[-2000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    llama_bench()
    bandwidth.append(read_bandwidth_alone())
    tokens = {name: r.pop("tokens") for name, r in results.items()}
    reference = tokens["transformers"]
    for name, r in results.items():  # greedy tokens shared with transformers, from the start
        r["same_prefix"] = next((i for i, (a, b) in enumerate(zip(tokens[name], reference, strict=True))
                                 if a != b), len(reference))
    rates = {name: (harness.Timing(tuple(r.pop("decode_tok_s"))),
                    harness.Timing(tuple(r.pop("prefill_tok_s")))) for name, r in results.items()}
    for name, r in results.items():
        decode, prefill = rates[name]
        r["decode_tok_s"], r["prefill_tok_s"] = decode.median, prefill.median
        record.figure(f"{name}, decode (greedy {NEW_TOKENS})", decode, "tokens/s")
        record.figure(f"{name}, prefill ({PREFILL})", prefill, "tokens/s")
        record.figure(f"{name}, load", r["load_s"], "s", cpu_seconds=r["load_cpu_s"])
        record.figure(f"{name}, peak memory (load + {NEW_TOKENS} tokens)", r["decode_peak_mb"], "MB")
        record.figure(f"{name}, peak memory", r["peak_mb"], "MB")
        record.notes[f"{name}: greedy tokens equal to transformers'"] = r["same_prefix"]
        if name != "transformers":
            theirs = rates["transformers"][0].median
            record.ratio(f"{name} / transformers decode rate", decode.median / theirs)
    if "llama.cpp" in rates and "glassformer gguf" in rates:
        record.ratio("glassformer gguf / llama.cpp decode rate",
                     rates["glassformer gguf"][0].median / rates["llama.cpp"][0].median)
    record.figure("read bandwidth (torch.sum over 1 GiB, before and after)",
                  harness.Timing(tuple(b / 1e9 for b in bandwidth)), "GB/s")
    roofline = roofline_rows(results, max(bandwidth), record)
    if bench_rates:
        tg = harness.Timing(tuple(bench_rates))
        record.figure(f"llama.cpp llama-bench tg{NEW_TOKENS} (before and after)", tg, "tokens/s")
        for name in ("glassformer gguf", "glassformer int4"):
            if name in rates:
                record.ratio(f"{name} / llama-bench decode rate", rates[name][0].median / tg.median)
    if bench_k_rates and "glassformer gguf Q4_K_M" in rates:
        tg = harness.Timing(tuple(bench_k_rates))
        record.figure(f"llama.cpp llama-bench tg{NEW_TOKENS}, Q4_K_M (before and after)", tg, "tokens/s")
        record.ratio("glassformer gguf Q4_K_M / llama-bench Q4_K_M decode rate",
                     rates["glassformer gguf Q4_K_M"][0].median / tg.median)
    record.write()
    if args.json:
        print(json.dumps(results))
        return
    theirs = results["transformers"]
    rows = [("decode tokens/s (greedy 128)", "decode_tok_s", True),
            (f"prefill tokens/s ({PREFILL})", "prefill_tok_s", True),
            ("load wall seconds", "load_s", False), ("load CPU seconds", "load_cpu_s", False),
            ("peak MB after load", "load_peak_mb", False),
            (f"peak MB after load + {NEW_TOKENS} tokens", "decode_peak_mb", False),
            ("peak MB overall", "peak_mb", False),
            ("greedy tokens equal to transformers'", "same_prefix", None)]
    names = list(results)
    print(f"SmolLM2-135M-Instruct Q4_1, {theirs['threads']} threads; (x): transformers / glassformer, "
          "> 1 is glassformer better")
    print(f"{'':<36}" + "".join(f"{n.replace('glassformer ', 'gf '):>19}" for n in names))
    for label, key, higher in rows:
        cells = []
        for name in names:
            value, base = results[name][key], theirs[key]
            ratio = (value / base if higher else base / value) if value and base else float("nan")
            shown = name != "transformers" and higher is not None
            cells.append(f"{value:>9.1f}" + (f" ({ratio:5.2f}x)" if shown else " " * 9))
        print(f"{label:<36}" + "".join(f"{c:>19}" for c in cells))
    print(f"\nread bandwidth {max(bandwidth) / 1e9:.1f} GB/s (the higher of "
          f"{', '.join(f'{b / 1e9:.1f}' for b in bandwidth)}, before and after)")
    print(f"{'':<20}{'MB a token':>12}{'roofline tok/s':>16}{'decode tok/s':>14}{'of roofline':>13}")
    for name, (mb, ceiling, decode) in roofline.items():
        print(f"{name:<20}{mb:>12.1f}{ceiling:>16.1f}{decode:>14.1f}{decode / ceiling:>13.0%}")
    for label, values in (("", bench_rates), (" Q4_K_M", bench_k_rates)):
        if values:
            print(f"llama-bench tg{NEW_TOKENS}{label}: {', '.join(f'{v:.1f}' for v in values)} tokens/s")
    if bench_rates or bench_k_rates:
        for name, value in record.ratios.items():
            if "llama-bench" in name:
                print(f"{name}: {value:.2f}x")


def roofline_rows(results: dict, bandwidth: float, record: harness.Record) -> dict[str, tuple]:
    """Per Glassformer mode: (MB of weights a token reads, the tokens/s the read bandwidth
    allows, the decode rate); the fraction of the roofline in `record`."""
    rows = {}
    for name, r in results.items():
        if "weight_bytes" in r:
            ceiling = bandwidth / r["weight_bytes"]
            rows[name] = (r["weight_bytes"] / 1e6, ceiling, r["decode_tok_s"])
            record.ratio(f"{name} decode / read roofline", r["decode_tok_s"] / ceiling)
    return rows


if __name__ == "__main__":
    main()
