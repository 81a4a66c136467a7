"""Long prefill on SmolLM2-135M-Instruct: time to first token and peak memory against prompt length.

Each prompt is the first n tokens of tinyshakespeare, prefilled through the dense KV cache in
chunks of --chunk tokens (each chunk attends to the cache and to itself through the model's
attention kernel: PyTorch's SDPA, whose CPU flash kernel never builds the n × n scores), then
the first token is picked. A prompt longer than the model's 8,192-token window is read with
the window extended --rope-scaling (YaRN by default, factor n / 8,192), or refused with one
line when --rope-scaling none. Each length runs in its own process: the model is loaded and
converted (--quantize, default bf16, the fastest prefill in docs/performance.md), the peak
resident memory is reset after one warm-up chunk (/proc/self/clear_refs), and the prefill is
timed (--repeats). The memory figures: the resident memory after loading (the model), the peak
during the prefill, their difference per prompt token (the KV cache's own bytes per token
beside it), and the peak's growth per extra token from one length to the next, which stays
flat when memory is linear in the prompt (n × n scores would make it grow with n).

    .venv/bin/python benchmarks/long_prefill.py [--lengths 1024 2048 4096 8192 16384 32768]
        [--quantize bf16] [--chunk 512] [--kv-dtype fp32] [--rope-scaling yarn] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import harness

from glassformer.data import tinyshakespeare
from glassformer.experiments.memory import peak_memory_mb, reset_peak_memory, resident_mb
from glassformer.model.kv_formats import KV_DTYPES

CORPUS = tinyshakespeare()
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)


def _prompt(tokenizer, text: str, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:  # the corpus again when it is shorter than the prompt
        ids += tokenizer.encode(text[: 8 * n])
    return ids[:n]


def worker(args: argparse.Namespace) -> dict:
    import torch

    from glassformer import load
    from glassformer.accel.quantize import quantize_format, quantize_model
    from glassformer.generation.context_extension import extend_context
    from glassformer.generation.core import prefill
    from glassformer.model.kv_cache import KVCache
    from glassformer.model.kv_formats import bytes_per_vector

    n = args.worker
    language_model = load("smollm2-135m-instruct", quantize=None, progress=False)
    model, native = language_model.model, language_model.model.config.context_length
    factor = 1.0
    if n > native:
        if args.rope_scaling == "none":
            raise ValueError(f"prompt: {n} tokens exceed the {native}-token window (--rope-scaling "
                             "yarn/ntk/linear extends it)")
        factor = n / native
        model = extend_context(model, args.rope_scaling, factor)
    quantize_model(model, quantize_format(args.quantize))
    model.eval()
    ids = torch.tensor([_prompt(language_model.tokenizer, Path(args.data).read_text(), n)])  # (1, n)

    def run() -> int:
        cache = KVCache(model.config, 1, max_length=n, kv_dtype=args.kv_dtype)
        with torch.inference_mode():
            for start in range(0, n, args.chunk):
                logits = prefill(model, ids[:, start : start + args.chunk], cache)  # (1, V)
        return int(logits.argmax(-1))

    model_mb = resident_mb("VmRSS")
    with torch.inference_mode():  # warm the kernels up on one chunk
        prefill(model, ids[:, : args.chunk], KVCache(model.config, 1, max_length=args.chunk))
    reset_peak_memory()  # the peak (VmHWM) starts again from here
    start = time.perf_counter()
    ttft = harness.timed(run, args.repeats, warmup=0)
    wall = time.perf_counter() - start
    config = model.config
    kv_per_token = 2 * config.n_layers * config.kv_heads * bytes_per_vector(args.kv_dtype, config.head_dim)
    return {"n": n, "ttft_s": list(ttft.samples), "wall_s": wall, "model_mb": model_mb,
            "peak_mb": peak_memory_mb(), "kv_bytes_per_token": kv_per_token, "factor": factor,
            "kernel": config.attention_kernel, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="prompt tokens")
    parser.add_argument("--quantize", default="bf16", help="weight format (default bf16)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk in tokens (default 512)")
    parser.add_argument("--kv-dtype", default="fp32", choices=tuple(KV_DTYPES),
                        help="the KV cache's format (default fp32)")
    parser.add_argument("--rope-scaling", default="yarn", choices=("none", "linear", "ntk", "yarn"),
                        help="past the native window (default yarn; none refuses longer prompts)")
    parser.add_argument("--data", type=Path, default=CORPUS, help="the text prompts are cut from")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    harness.add_arguments(parser, repeats=1)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.worker:
        try:
            print(json.dumps(worker(args)))
        except ValueError as error:
            sys.exit(f"long_prefill: {error}")
        return
    record = harness.start("long_prefill", args)
    forwarded = ["--quantize", args.quantize, "--chunk", str(args.chunk), "--kv-dtype", args.kv_dtype,
                 "--rope-scaling", args.rope_scaling, "--data", str(args.data), "--repeats",
                 str(args.repeats)] + (["--threads", str(args.threads)] if args.threads else [])
    print(f"{'tokens':>7} {'TTFT s':>9} {'tokens/s':>9} {'model MB':>9} {'peak MB':>9} "
          f"{'growth B/token':>15} {'KV B/token':>11} {'RoPE x':>7}")
    peaks = {}
    for n in args.lengths:
        done = subprocess.run([sys.executable, __file__, "--worker", str(n), *forwarded],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            print(f"{n:>7} {done.stderr.strip().splitlines()[-1]}")
            record.notes[f"{n} tokens"] = done.stderr.strip().splitlines()[-1]
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        ttft = harness.Timing(tuple(r["ttft_s"]))
        peaks[n] = r["peak_mb"]
        growth = (r["peak_mb"] - r["model_mb"]) * 2**20 / n
        context = {"tokens": n, "rope_factor": r["factor"], "kernel": r["kernel"]}
        record.figure(f"time to first token, {n} tokens", ttft, "s", **context)
        record.figure(f"prefill rate, {n} tokens", ttft.per(n), "tokens/s", **context)
        record.figure(f"peak resident, {n} tokens", r["peak_mb"], "MB", model_mb=r["model_mb"], **context)
        record.figure(f"memory growth per token, {n} tokens", growth, "bytes/token",
                      kv_cache_bytes_per_token=r["kv_bytes_per_token"], **context)
        print(f"{n:>7} {ttft.median:>9.2f} {n / ttft.median:>9.1f} {r['model_mb']:>9.0f} "
              f"{r['peak_mb']:>9.0f} {growth:>15,.0f} {r['kv_bytes_per_token']:>11,} {r['factor']:>7.2f}")
    lengths = sorted(peaks)
    slopes = []
    for a, b in zip(lengths, lengths[1:], strict=False):  # flat when memory is linear
        slopes.append((peaks[b] - peaks[a]) * 2**20 / (b - a))
        record.figure(f"peak memory per extra token, {a} to {b} tokens", slopes[-1], "bytes/token")
        print(f"peak memory per extra token from {a} to {b} tokens: {slopes[-1]:,.0f} bytes")
    if len(slopes) > 1:
        record.ratio("peak memory per extra token, last / first interval", slopes[-1] / slopes[0])
    record.notes.update({"chunk": args.chunk, "quantize": args.quantize, "kv_dtype": args.kv_dtype,
                         "corpus": str(args.data), "rope_scaling": args.rope_scaling})
    record.write()


if __name__ == "__main__":
    main()
