"""Where a decode step's weight reads go for a GGUF file: each block type's products over all
of its tensors, one activation row (or --rows), as GB/s beside the machine's read ceiling.

For every block type the file holds (Q4_K, Q6_K, Q5_0, Q8_0, ...), one round multiplies a
row by each of its 2-D tensors, as a decode step does (a tied head's table counts once, as
the head reads it). The read ceiling is `torch.sum` over a float32 array of the file's size,
timed in the same rounds. With `--against REV` the K-quant kernels (csrc/kquants.cpp) of git
revision REV are built beside the working tree's and timed in alternate rounds: the ratio of
their times is what a kernel change gains, whatever else the machine is doing.

    python benchmarks/gguf_kernels.py FILE.gguf [--rows M] [--against main] [--repeats N]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

import gguf
import harness
import numpy as np
import torch

from glassformer.accel import QuantizedLinear, build, kernels, kquants

REPO = Path(__file__).resolve().parents[1]


def tensors_by_type(path: Path) -> dict[str, list[QuantizedLinear]]:
    """The file's 2-D tensors of kept block types as layers, grouped by type name."""
    reader = gguf.GGUFReader(path)
    groups: dict[str, list[QuantizedLinear]] = defaultdict(list)
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if len(tensor.shape) != 2 or name in ("F32", "F16", "BF16"):
            continue
        k, n = (int(s) for s in tensor.shape)
        groups[name].append(QuantizedLinear.from_gguf(np.asarray(tensor.data), name, (n, k)))
    return dict(groups)


def revision_kernels(revision: str):
    """The extension compiled from `revision`'s csrc/ (native target), in a folder of its own."""
    from torch.utils import cpp_extension

    folder = Path(tempfile.mkdtemp(prefix="gf-kernels-"))
    listing = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", revision,
                              "glassformer/accel/csrc/"], capture_output=True, text=True, check=True)
    sources = []
    for name in listing.stdout.split():
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{name}"],
                              capture_output=True, text=True, check=True).stdout
        (folder / Path(name).name).write_text(text)
        if name.endswith(".cpp"):
            sources.append(str(folder / Path(name).name))
    return cpp_extension.load(name=f"gf_kernels_{revision.replace('/', '_')}", sources=sources,
                              extra_cflags=build.cflags("native"), extra_ldflags=build.LDFLAGS,
                              build_directory=str(folder), verbose=False)


def weight_bytes(layer: QuantizedLinear) -> int:
    return sum(b.numel() * b.element_size() for name, b in layer.named_buffers() if name != "bias")


def products(layers: list[QuantizedLinear], rows: int, ext=None):
    """One round over the layers: x (rows, K) times each, by `ext`'s linear_gguf where given."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, layer.in_features, generator=g) for layer in layers]  # (M, K) each

    def run():
        for layer, x in zip(layers, xs, strict=True):
            if ext is None:
                layer(x)
            else:
                ext.linear_gguf(x, layer.qweight, ext.WeightFormat.__members__[layer.mode.value], None)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--against", help="a git revision whose K-quant kernels to time beside")
    harness.add_arguments(parser, repeats=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    record = harness.start("gguf_kernels", args)
    groups = tensors_by_type(args.file)
    sizes = {name: sum(weight_bytes(layer) for layer in layers) for name, layers in groups.items()}
    total = sum(sizes.values())
    ceiling_array = torch.ones(total // 4)  # (file bytes / 4,) float32: the read ceiling's data
    runs = {"read ceiling": ceiling_array.sum}
    old = revision_kernels(args.against) if args.against else None
    for name, layers in groups.items():
        runs[name] = products(layers, args.rows)
        if old is not None and name in kquants.BY_TYPE:
            runs[f"{name} @{args.against}"] = products(layers, args.rows, old)
    for run in runs.values():
        run()  # builds, caches warm
    with torch.no_grad():
        timings = harness.alternating(runs, args.repeats)
    seconds = {name: timing.median for name, timing in timings.items()}
    ceiling = total / seconds["read ceiling"]
    print(harness.cpu_line())
    print(f"{args.file.name}: {total / 1e6:.1f} MB of products, rows {args.rows}; read ceiling "
          f"{ceiling / 1e9:.1f} GB/s; kernels {'built' if kernels.available() else 'missing'}")
    print(f"{'type':<16}{'MB':>8}{'share':>8}{'ms':>9}{'GB/s':>8}{'of ceiling':>12}{'vs old':>8}")
    step = 0.0
    for name in groups:
        t = seconds[name]
        step += t
        rate = sizes[name] / t
        against = f"{name} @{args.against}"
        gain = f"{seconds[against] / t:>7.2f}x" if against in seconds else ""
        print(f"{name:<16}{sizes[name] / 1e6:>8.1f}{sizes[name] / total:>8.0%}{t * 1e3:>9.2f}"
              f"{rate / 1e9:>8.1f}{rate / ceiling:>12.0%}{gain}")
        record.figure(name, timings[name].scaled(1e3), "ms", gb_per_s=rate / 1e9)
        if against in seconds:
            record.ratio(f"{args.against} / this time, {name}", seconds[against] / t)
    print(f"{'all':<16}{total / 1e6:>8.1f}{'':>8}{step * 1e3:>9.2f}{total / step / 1e9:>8.1f}"
          f"{total / step / ceiling:>12.0%}")
    record.write()


if __name__ == "__main__":
    main()
