"""The int8 / int4 kernels at 1 to 300 rows: ms per product against F.linear on float32.

A decode step of M sequences multiplies M rows by every weight; a prefill multiplies one row
per prompt token. The kernels load each weight block once per tile of rows, so M rows should
cost far less than M products of one row. For each weight shape (out, in) and format this
times one product of M rows with the kernels of this build, with F.linear on the float32
weight, and, with `--compare-build PATH` (another build's .so, e.g. one compiled from older
sources), with that build too, all in alternating rounds of one process. Ratios: M rows
against M = 1 (the cost of the extra rows) and each kernel against F.linear.
Run: .venv/bin/python benchmarks/quantized_gemm.py [--rows 1 8 64 300] [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import harness
import torch
import torch.nn.functional as F

from glassformer.accel import kernels
from glassformer.accel import weight_formats as quant
from glassformer.accel.tile_order import to_tile_order

SHAPES = ((576, 1536), (960, 576), (49152, 576))  # (out, in): down, qkv (K = 18 blocks), LM head


def load_build(path: Path):
    """Another compiled build of the kernels, imported from its .so file."""
    name = path.name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def products(ext, fmt: str, weight: torch.Tensor):
    """x -> x @ weightᵀ through `ext`'s kernel for `fmt`, the blocks in the order it reads
    (tile order; older builds said which with `tile_order()`: their AVX2 build read block order)."""
    blocks = quant.quantize_int8(weight) if fmt == "int8" else quant.quantize_int4(weight)
    if getattr(ext, "tile_order", lambda: True)():
        blocks = [to_tile_order(t, unit) for t, unit in zip(blocks, (4, 1, 1), strict=False)]
    if fmt == "int8":
        return lambda x: ext.linear_q8(x, *blocks, None)
    return lambda x: ext.linear_q4(x, *blocks, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 300])
    parser.add_argument("--formats", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compare-build", type=Path, default=None,
                        help="another build's .so, timed beside this one")
    harness.add_arguments(parser, repeats=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.available():
        raise SystemExit("the C++ kernels are not available here")
    record = harness.start("quantized_gemm", args)
    builds = {"kernel": kernels.extension()}
    if args.compare_build is not None:
        builds["compared build"] = load_build(args.compare_build)
        record.notes["compared build"] = str(args.compare_build)
    g = torch.Generator().manual_seed(0)
    print(f"{'shape':<13}{'format':<7}{'M':>5}" + "".join(f"{n + ' ms':>20}" for n in builds)
          + f"{'F.linear ms':>13}{'kernel / M=1':>14}{'µs per row':>12}{'F.linear / kernel':>19}")
    with torch.no_grad():
        for n, k in SHAPES:
            weight = torch.randn(n, k, generator=g) * 0.02  # (N, K)
            for fmt in args.formats:
                runs = {name: products(ext, fmt, weight) for name, ext in builds.items()}
                one_row = None
                for m in args.rows:
                    x = torch.randn(m, k, generator=g)  # (M, K)
                    contenders = {name: (lambda f=f, x=x: f(x)) for name, f in runs.items()}
                    contenders["F.linear"] = lambda x=x, w=weight: F.linear(x, w)
                    timings = harness.alternating(contenders, args.repeats)
                    ms = {name: t.median * 1e3 for name, t in timings.items()}
                    one_row = ms["kernel"] if m == 1 else one_row
                    shape = f"{n}x{k}"
                    for name, timing in timings.items():
                        record.figure(f"{name} {fmt} {shape} M={m}", timing.scaled(1e3), "ms")
                    growth = ms["kernel"] / one_row if one_row else float("nan")
                    per_row = (ms["kernel"] - one_row) * 1e3 / (m - 1) if one_row and m > 1 \
                        else float("nan")
                    if m > 1:
                        record.figure(f"kernel {fmt} {shape}: µs per row past the first at M={m}",
                                      per_row, "us")
                    record.ratio(f"kernel {fmt} {shape}: M={m} / M=1 time", growth)
                    record.ratio(f"F.linear / kernel {fmt} {shape} M={m} time",
                                 ms["F.linear"] / ms["kernel"])
                    if "compared build" in ms:
                        record.ratio(f"compared build / kernel {fmt} {shape} M={m} time",
                                     ms["compared build"] / ms["kernel"])
                    print(f"{shape:<13}{fmt:<7}{m:>5}" + "".join(f"{ms[b]:>20.3f}" for b in builds)
                          + f"{ms['F.linear']:>13.3f}{growth:>14.2f}{per_row:>12.1f}"
                          f"{ms['F.linear'] / ms['kernel']:>19.2f}", flush=True)
    record.write()


if __name__ == "__main__":
    main()
