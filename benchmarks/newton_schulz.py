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

import harness
import torch

from glassformer import Transformer
from glassformer.training.config import get_recipe
from glassformer.training.optim import make_optimizer, newton_schulz_dtype, orthogonalize


def step_run(stacks: list[torch.Tensor], dtype: torch.dtype, group: dict):
    """One optimizer step's iterations over every stack."""
    def run():
        for stack in stacks:
            orthogonalize(stack, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_arguments(parser, repeats=20)
    args = parser.parse_args()
    record = harness.start("newton_schulz", args)
    recipe = get_recipe("shakespeare-char-fast")
    model = Transformer(recipe.model.replace(vocab_size=65))
    muon = make_optimizer(model, recipe.train).optimizers[0]
    group = muon.param_groups[0]
    shapes: dict[torch.Size, int] = {}
    for p in group["params"]:
        shapes[p.shape] = shapes.get(p.shape, 0) + 1
    stacks = [torch.randn(n, *shape) for shape, n in shapes.items()]  # (n, rows, cols) each
    print("stacks: " + ", ".join(f"{n} × {tuple(s)}" for s, n in shapes.items()))
    times = harness.alternating({"bfloat16": step_run(stacks, torch.bfloat16, group),
                                 "float32": step_run(stacks, torch.float32, group)}, args.repeats)
    for name, timing in times.items():
        print(f"Newton–Schulz per step, {name}: {timing.scaled(1e3).text('ms')}")
        record.figure(f"Newton–Schulz per step, {name}", timing.scaled(1e3), "ms")
    ratio = times["bfloat16"].median / times["float32"].median
    chosen = str(newton_schulz_dtype(torch.device("cpu")))
    print(f"bfloat16 / float32 time {ratio:.2f}; Glassformer uses {chosen} here")
    record.ratio("bfloat16 / float32 time", ratio)
    record.notes["chosen dtype"] = chosen
    record.write()


if __name__ == "__main__":
    main()
