"""Muon's Newton–Schulz iterations in bfloat16 (torch.optim.Muon's dtype) and in float32, on
the matrices of the `shakespeare-char-fast` preset, stacked by shape as StackedMuon runs
them; prints ms per optimizer step for each, their ratio, and the dtype Glassformer chooses
on this CPU (glassformer/accel/cpu.py). Run it also under AVX2 dispatch to see a CPU without
bfloat16 arithmetic:

    python benchmarks/newton_schulz.py [--repeats 20]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/newton_schulz.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cpu_report import print_cpu

from glassformer import Transformer
from glassformer.training.config import get_recipe
from glassformer.training.optim import make_optimizer, newton_schulz_dtype, orthogonalize


def step_ms(stacks: list[torch.Tensor], dtype: torch.dtype, group: dict, repeats: int) -> float:
    """Median ms of one step's iterations over every stack."""
    def run():
        for stack in stacks:
            orthogonalize(stack, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)

    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print_cpu()
    recipe = get_recipe("shakespeare-char-fast")
    model = Transformer(recipe.model.replace(vocab_size=65))
    muon = make_optimizer(model, recipe.train).optimizers[0]
    group = muon.param_groups[0]
    shapes: dict[torch.Size, int] = {}
    for p in group["params"]:
        shapes[p.shape] = shapes.get(p.shape, 0) + 1
    stacks = [torch.randn(n, *shape) for shape, n in shapes.items()]  # (n, rows, cols) each
    print("stacks: " + ", ".join(f"{n} × {tuple(s)}" for s, n in shapes.items()))
    bf16 = step_ms(stacks, torch.bfloat16, group, args.repeats)
    fp32 = step_ms(stacks, torch.float32, group, args.repeats)
    print(f"Newton–Schulz per step: bfloat16 {bf16:.2f} ms, float32 {fp32:.2f} ms, "
          f"bfloat16 / float32 time {bf16 / fp32:.2f}; "
          f"Glassformer uses {newton_schulz_dtype(torch.device('cpu'))} here")


if __name__ == "__main__":
    main()
