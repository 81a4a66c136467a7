"""The AVX2 int4 / int8 products at 8 rows against the peak of their own integer arithmetic.

Without VNNI an int8 dot product of 32 bytes is a maddubs and an add (q4) or two signs, a
maddubs, a madd and an add (q8), where VNNI has one vpdpbusd for 64 (accel/csrc/quantized.cpp).
This compiles `int8_peak.c` (those instructions alone, over activations in the L1 cache, no
weight loaded or unpacked) for AVX2 and times it beside the kernels' products of 8 rows, one
thread, in alternating rounds: multiply-adds per second each, and the kernel's fraction of the
arithmetic alone (with and without the per-block float work every product must do). A kernel
near 1 is bound by the arithmetic; more rows a step cannot make it faster.
Run: GLASSFORMER_KERNEL_TARGET=avx2 .venv/bin/python benchmarks/int8_peak.py
(the kernels' AVX2 build; without it, this machine's own build is timed beside the AVX2 probe).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path

import harness
import torch
from quantized_gemm import products

from glassformer.accel import decisions, kernels

SOURCE = Path(__file__).resolve().parent / "int8_peak.c"
SHAPES = ((576, 576), (1536, 576), (576, 1536))  # (out, in): SmolLM2-135M's products
ROWS = 8
PROBE_BLOCKS = 1 << 20  # blocks of 4 rows a probe call runs: 1,024 multiply-adds each
KERNEL_MACS = 1 << 29  # multiply-adds a kernel's round runs, in as many calls as that takes


def compile_probe(directory: Path) -> ctypes.CDLL:
    """int8_peak.c built for AVX2 (x86-64-v3) as a shared library."""
    library = directory / "int8_peak.so"
    subprocess.run(["cc", "-O3", "-march=x86-64-v3", "-shared", "-fPIC", str(SOURCE), "-o", str(library)],
                   check=True)
    probe = ctypes.CDLL(str(library))
    for name in ("q4_blocks", "q8_blocks"):
        getattr(probe, name).restype = ctypes.c_float
        getattr(probe, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    return probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_arguments(parser, repeats=5)
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("the C++ kernels are not available here")
    torch.set_num_threads(1)
    record = harness.start("int8_peak", args)
    record.notes["kernel build"] = decisions.kernel_target().choice
    activations = torch.randint(-127, 128, (16 * 128,), dtype=torch.int8)  # 16 blocks of 4 rows
    scales = torch.rand(16 * 8)  # (16 blocks × (4 scales, 4 sums),)
    x_ptr, scales_ptr = activations.data_ptr(), scales.data_ptr()
    probe_macs = PROBE_BLOCKS * 4 * 8 * 32  # blocks × rows × lanes × inputs
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        probe = compile_probe(Path(directory))
        print(f"{'format':<7}{'shape':<11}{'kernel GMAC/s':>15}{'arithmetic alone':>18}"
              f"{'with float work':>17}{'kernel / alone':>16}{'kernel / with float':>21}")
        for fmt, loop in (("int4", probe.q4_blocks), ("int8", probe.q8_blocks)):
            contenders = {
                "alone": lambda loop=loop: loop(x_ptr, scales_ptr, PROBE_BLOCKS, 0),
                "with float work": lambda loop=loop: loop(x_ptr, scales_ptr, PROBE_BLOCKS, 1)}
            macs = {"alone": probe_macs, "with float work": probe_macs}
            for n, k in SHAPES:
                weight = torch.randn(n, k, generator=g) * 0.02  # (N, K)
                x = torch.randn(ROWS, k, generator=g)  # (8, K)
                product = products(kernels.extension(), fmt, weight)
                calls = max(1, KERNEL_MACS // (n * k * ROWS))  # a round of milliseconds, as the probe's

                def run(product=product, x=x, calls=calls) -> None:
                    for _ in range(calls):
                        product(x)

                contenders[f"kernel {n}x{k}"] = run
                macs[f"kernel {n}x{k}"] = calls * n * k * ROWS
            with torch.no_grad():
                timings = harness.alternating(contenders, args.repeats)
            rate = {name: macs[name] / t.median / 1e9 for name, t in timings.items()}
            for name, t in timings.items():
                record.figure(f"{fmt} {name}", t.per(macs[name] / 1e9), "s/GMAC")
            for n, k in SHAPES:
                kernel = rate[f"kernel {n}x{k}"]
                record.ratio(f"{fmt} {n}x{k} kernel / arithmetic alone", kernel / rate["alone"])
                record.ratio(f"{fmt} {n}x{k} kernel / with float work", kernel / rate["with float work"])
                print(f"{fmt:<7}{f'{n}x{k}':<11}{kernel:>15.1f}{rate['alone']:>18.1f}"
                      f"{rate['with float work']:>17.1f}{kernel / rate['alone']:>16.2f}"
                      f"{kernel / rate['with float work']:>21.2f}", flush=True)
    record.write()


if __name__ == "__main__":
    main()
