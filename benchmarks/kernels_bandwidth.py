"""One SmolLM2-135M decode step's weight products: torch F.linear fp32 vs each kernel format.

Shapes per layer (30 layers): qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576,
plus the head 576->49152. Prints ms per step, GB/s of weight bytes read, the speed-up over
F.linear, and the share of the read ceiling: `torch.sum` over the same fp32 weights, timed
in the same rounds, i.e. the memory bandwidth actually available while the script runs.
Run: .venv/bin/python benchmarks/kernels_bandwidth.py [--rows M] [--threads T]
"""

from __future__ import annotations

import argparse

import harness
import torch
import torch.nn.functional as F

from glassformer.accel import QuantizedLinear

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
HEAD = (49152, 576)


def step_shapes(n_layers: int) -> list[tuple[int, int]]:
    return LAYER * n_layers + [HEAD]


def weight_bytes(layer: QuantizedLinear) -> int:
    return sum(b.numel() * b.element_size() for n, b in layer.named_buffers() if n != "bias")


def step_run(fns, xs):
    """One pass over all products."""
    def run():
        for fn, x in zip(fns, xs, strict=True):
            fn(x)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1, help="activation rows M (batch)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    harness.add_arguments(parser, repeats=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    record = harness.start("kernels_bandwidth", args)
    g = torch.Generator().manual_seed(0)
    shapes = step_shapes(args.layers)
    weights = [torch.randn(n, k, generator=g) * 0.02 for n, k in shapes]
    xs = [torch.randn(args.rows, k, generator=g) for _, k in shapes]  # (M, K)

    fp32_bytes = sum(w.numel() * 4 for w in weights)
    # the read ceiling of this machine at this moment: summing the same fp32 bytes
    variants = {"read ceiling": [lambda x, w=w: w.sum() for w in weights],
                "torch F.linear": [lambda x, w=w: F.linear(x, w) for w in weights]}
    n_bytes = {"read ceiling": fp32_bytes, "torch F.linear": fp32_bytes}
    for mode in ("fp32", "bf16", "int8", "int4"):
        layers = [QuantizedLinear.from_weight(w, mode) for w in weights]
        layers[0](xs[0])  # builds the extension if needed
        variants[f"kernel {mode}"] = layers
        n_bytes[f"kernel {mode}"] = sum(weight_bytes(layer) for layer in layers)
    with torch.no_grad():  # rounds interleaved, so load from other processes falls on every variant alike
        timings = harness.alternating({name: step_run(fns, xs) for name, fns in variants.items()},
                                      args.repeats, warmup=0)
    seconds = {name: timing.median for name, timing in timings.items()}
    base = seconds["torch F.linear"]
    print(f"{args.layers} layers + head, M={args.rows}; median of {args.repeats} rounds")
    ceiling = fp32_bytes / seconds["read ceiling"]
    print(f"{'format':<16}{'MB read':>9}{'ms/step':>10}{'GB/s':>8}{'vs F.linear':>13}"
          f"{'of ceiling':>12}")
    for name, t in seconds.items():
        rate = n_bytes[name] / t
        print(f"{name:<16}{n_bytes[name] / 1e6:>9.1f}{t * 1e3:>10.2f}{rate / 1e9:>8.1f}"
              f"{base / t:>12.2f}x{rate / ceiling:>11.0%}")
        record.figure(f"{name}, one step", timings[name].scaled(1e3), "ms", gb_per_s=rate / 1e9)
        if name.startswith("kernel"):
            record.ratio(f"torch F.linear / {name} time", base / t)
    record.write()


if __name__ == "__main__":
    main()
