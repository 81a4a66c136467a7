"""A 1 B model as users download it, beside llama.cpp on the same file: peak memory, load time,
decode and prefill.

The model is shaped like Llama 3.2 1B (16 layers of 2,048, 32 query and 8 key heads, 8,192 wide
feed-forward, Llama 3's 128,256-token vocabulary from llama.cpp's ggml-vocab-llama-bpe.gguf,
tied head, Llama 3.1's RoPE bands), with random weights made by transformers and saved in
bf16; llama.cpp's converter writes it as f16 GGUF and `llama-quantize` as Q4_K_M.

    python benchmarks/large_gguf.py --llama-cpp PATH/llama.cpp --dir DIR [--rounds 2] [--json]

Each round runs, in turn: `glassformer generate --quantize gguf` (a new process: its peak RSS
from the kernel, its load time and decode / prefill speeds from --json) and `llama-bench` on
the same file with the same thread count. Prints the figures and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import llama_binaries

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
             tie_word_embeddings=True, rope_scaling={
                 "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
PROMPT = "The meaning of life is"


def make(llama_cpp: Path, folder: Path) -> Path:
    """The HF folder, its f16 GGUF and the Q4_K_M file (each made once)."""
    quantized = folder.with_name(folder.name + ".Q4_K_M.gguf")
    if quantized.is_file():
        return quantized
    import torch
    import transformers

    sys.path.insert(0, str(REPO))
    from glassformer.formats.gguf_file import GGUFFile
    from glassformer.formats.gguf_tokenizer import from_gguf_metadata

    with GGUFFile(llama_cpp / "models/ggml-vocab-llama-bpe.gguf") as file:
        tokenizer = from_gguf_metadata(file.metadata)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(folder / "tokenizer.json")
    config = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                      eos_token_id=tokenizer.eos_id, initializer_range=0.02, **SHAPE)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    f16 = llama_binaries.convert_hf(llama_cpp, folder, folder.with_name(folder.name + ".f16.gguf"), "f16")
    return llama_binaries.quantize(llama_cpp / "build/bin", f16, quantized, "Q4_K_M")


def glassformer_run(path: Path, threads: int, n: int) -> dict:
    command = [sys.executable, "-m", "glassformer", "generate", "--model", str(path),
               "--quantize", "gguf", "-n", str(n), "--ignore-eos", "--json", PROMPT]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=os.environ | {"GLASSFORMER_THREADS": str(threads)})
    stdout = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak, not the largest so far
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if child.returncode != 0:
        raise RuntimeError(f"glassformer generate exited {child.returncode}")
    out = json.loads(stdout)
    peak = usage.ru_maxrss / 1024  # MB
    return {"decode": out["decode_tokens_per_second"], "prefill": out["prefill_tokens_per_second"],
            "load_seconds": out["load_seconds"], "wall_seconds": wall, "peak_rss_mb": peak}


def llama_bench(llama_cpp: Path, path: Path, threads: int, n: int, repack: int) -> dict:
    """llama-bench's decode (tg) and prefill (pp64) speeds. `repack` 1: its fastest decode on
    CPUs with AMX, whose batched products die with SIGILL under some hypervisors; so prefill
    runs with repack 0 (as llama-server's LLAMA_ARG_REPACK=0)."""
    speed = {}
    for kind, counts in (("decode", ["-p", "0", "-n", str(n), "--repack", str(repack)]),
                         ("prefill", ["-p", "64", "-n", "0", "--repack", "0"])):
        done = subprocess.run([str(llama_cpp / "build/bin/llama-bench"), "-m", str(path), "-t",
                               str(threads), *counts, "-r", "2", "-o", "json"],
                              capture_output=True, text=True, check=True)
        speed[kind] = json.loads(done.stdout)[0]["avg_ts"]
    return speed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--dir", type=Path, required=True, help="where the model files are made")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repack", type=int, choices=(0, 1), default=1,
                        help="llama-bench's --repack for its decode")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    path = make(args.llama_cpp, args.dir / "llama-3.2-1b-shaped")
    rounds = []
    for _ in range(args.rounds):
        ours = glassformer_run(path, args.threads, args.tokens)
        theirs = llama_bench(args.llama_cpp, path, args.threads, args.tokens, args.repack)
        rounds.append({"glassformer": ours, "llama.cpp": theirs,
                       "decode_ratio": ours["decode"] / theirs["decode"]})
    result = {"file": str(path), "file_mb": path.stat().st_size / 2**20, "rounds": rounds}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{path.name}: {result['file_mb']:.0f} MB")
    for r in rounds:
        g, lc = r["glassformer"], r["llama.cpp"]
        print(f"decode {g['decode']:.1f} vs llama-bench {lc['decode']:.1f} tokens/s "
              f"({r['decode_ratio']:.2f}x); prefill {g['prefill']:.1f} vs {lc['prefill']:.1f}; "
              f"peak RSS {g['peak_rss_mb']:.0f} MB; load {g['load_seconds']} s")


if __name__ == "__main__":
    main()
