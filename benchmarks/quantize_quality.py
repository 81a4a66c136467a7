"""What each --quantize mode costs in quality: SmolLM2-135M perplexity on held-out text.

The text is the first 20,000 characters of tinyshakespeare (never seen in SmolLM2's weights as
such a file, and not part of any Glassformer training here), cut into windows of 512 tokens;
perplexity = exp(mean next-token cross-entropy) over every predicted token. Each mode loads
the model afresh through `glassformer.load(..., quantize=mode)`; "reference" is the float32
module path that matches transformers.

    .venv/bin/python benchmarks/quantize_quality.py [--chars 20000] [--window 512]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import harness
import torch
import torch.nn.functional as F

from glassformer import load
from glassformer.data import tinyshakespeare

MODES = ("reference", "none", "bf16", "int8", "int4", "gguf")
CORPUS = tinyshakespeare()


@torch.inference_mode()
def perplexity(model, ids: list[int], window: int) -> float:
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start : start + window + 1]])  # (1, ≤ window + 1)
        if chunk.shape[1] < 2:
            break
        logits = model(chunk[:, :-1])[0]  # (T, vocab)
        total += F.cross_entropy(logits.float(), chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return math.exp(total / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--data", default=str(CORPUS))
    harness.add_arguments(parser, repeats=None)
    args = parser.parse_args()
    record = harness.start("quantize_quality", args)
    text = Path(args.data).read_text(encoding="utf-8")[: args.chars]
    results = {}
    for mode in MODES:
        start = time.perf_counter()
        lm = load("smollm2-135m-instruct", quantize=None if mode == "reference" else mode,
                  progress=False)
        ids = lm.tokenizer.encode(text)
        results[mode] = perplexity(lm.model, ids, args.window)
        print(f"{mode:>10}  perplexity {results[mode]:8.3f}  "
              f"({100 * (results[mode] / results['reference'] - 1):+6.2f}% vs fp32)  "
              f"{len(ids)} tokens, {time.perf_counter() - start:.0f} s", flush=True)
        record.figure(f"{mode}, perplexity", results[mode], "perplexity", tokens=len(ids))
        record.ratio(f"{mode} / reference perplexity", results[mode] / results["reference"])
    record.write()


if __name__ == "__main__":
    main()
