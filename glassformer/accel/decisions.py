"""The CPU-dependent choices, each measured once per machine where it is first needed.

Three choices depend on what this CPU does fast, and flags do not tell: AVX-512 BF16 without
AMX multiplies bfloat16 slower than float32 at training's shapes, and MKL may or may not use
a CPU's AVX-512. So each choice is a short micro-benchmark of its options (best of a few
runs, interleaved), run at first use with a one-line notice and kept as a small JSON record
under `<home>/decisions/`, keyed by the CPU (model, flags, PyTorch's dispatch level), the
torch version and, for the kernel build, the builds' own keys; a later process reads it.

- `bf16_products`: "bfloat16" or "float32" products for training (autocast, Muon's
  Newton-Schulz iterations): a feed-forward's forward and backward, and an iteration stack.
- `onednn_products`: "onednn" or "mkl" for training's float32 linear products (onednn.py).
- `kernel_target`: the C++ build, "native" or "avx2" (build.py), on a CPU with AVX-512
  where both builds are already compiled (no build is started to measure it).

Flags may rule an option out (no bfloat16 arithmetic: PyTorch would emulate it, 10-20×
slower), never in. An alternative replaces the default only when it takes at most `MARGIN`
of its time. `GLASSFORMER_BF16=0/1`, `GLASSFORMER_ONEDNN=0/1` and
`GLASSFORMER_KERNEL_TARGET=native/avx2` override; `GLASSFORMER_KERNELS=torch` turns oneDNN
off with the C++ kernels; `ATEN_CPU_CAPABILITY=avx2` takes the AVX2 build.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..home import home
from . import build
from .cpu import cpu_features, cpu_identity, cpuinfo_text, parse
from .weight_formats import quantize_int8

REPEATS = 3  # timed runs per option after the warm-up; the best counts
WARM_LOSS, LOSS, BUDGET = 10.0, 3.0, 0.5  # see time_options
MARGIN = 0.95  # an alternative must take at most this fraction of the default's time
# (rows, d_model, d_ff): the character presets' feed-forward, and a wider one
TRAINING_SHAPES = ((768, 128, 336), (512, 256, 512))


@dataclass(frozen=True)
class Decision:
    name: str
    choice: str
    source: str  # "measured", "cached", "environment" or "ruled out"
    figures: dict[str, float] = field(default_factory=dict)  # option -> best seconds
    note: str = ""  # why, where not measured

    def to_dict(self) -> dict:
        return asdict(self)


def time_options(options: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each option's best time in seconds, over a timed warm-up and up to REPEATS runs taken
    in turn (a busy moment of the machine falls on all of them). An option far behind the
    best stops running: its warm-up over WARM_LOSS times the best warm-up, or its best over
    LOSS times the best; nothing more runs once BUDGET seconds have passed."""
    began = time.perf_counter()
    best = {name: _timed(run) for name, run in options.items()}
    first = min(best.values())
    running = [name for name in options if best[name] <= WARM_LOSS * first]
    for _ in range(REPEATS):
        for name in running:
            best[name] = min(best[name], _timed(options[name]))
        running = [name for name in running if best[name] <= LOSS * min(best.values())]
        if len(running) < 2 or time.perf_counter() - began > BUDGET:
            break
    return best


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def record_path(name: str, extra: str = "") -> Path:
    """Where `name`'s measured record for this CPU, torch (and `extra`) is kept."""
    key = "\0".join((cpu_identity(), torch.backends.cpu.get_cpu_capability(), torch.__version__,
                     extra))
    return home() / "decisions" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read(path: Path, name: str, options: tuple[str, ...]) -> Decision | None:
    """The record at `path`, or None where it is missing or not one of `name`'s."""
    try:
        saved = json.loads(path.read_text())
        figures = {option: float(saved["figures"][option]) for option in options}
        if saved["name"] != name or saved["choice"] not in options:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Decision(name, saved["choice"], "cached", figures)


def _write(path: Path, decision: Decision) -> None:
    """Keep the record (written whole, then renamed); an unwritable home only costs a
    measurement in the next process."""
    record = {**decision.to_dict(), "cpu": cpu_features().summary(), "torch": torch.__version__}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(record, indent=1))
        os.replace(partial, path)
    except OSError:
        pass


def measured(name: str, default: str, alternative: str,
              options: Callable[[], dict[str, Callable[[], object]]], extra: str = "") -> Decision:
    """`name`'s decision from its record, else measured now and recorded."""
    path = record_path(name, extra)
    found = _read(path, name, (default, alternative))
    if found is not None:
        return found
    print(f"glassformer: measuring {name} once on this CPU ({default} or {alternative})",
          file=sys.stderr, flush=True)
    figures = time_options(options())
    choice = alternative if figures[alternative] <= MARGIN * figures[default] else default
    decision = Decision(name, choice, "measured", figures)
    _write(path, decision)
    return decision


def env_setting(variable: str, allowed: tuple[str, ...]) -> str | None:
    """The variable's value where set, None where unset or empty."""
    value = os.environ.get(variable, "").strip().lower()
    if value and value not in allowed:
        raise InputError(None, f"{variable} must be one of {', '.join(allowed)}, got {value!r}")
    return value or None


# ------------------------------------------------------------------------ bfloat16 products

def bf16_products() -> Decision:
    setting = env_setting("GLASSFORMER_BF16", ("0", "1"))
    if setting is not None:
        return Decision("bf16_products", "bfloat16" if setting == "1" else "float32",
                        "environment", note=f"GLASSFORMER_BF16={setting}")
    return _bf16_products()


def bf16_products_pay() -> bool:
    """Whether training multiplies in bfloat16 on this CPU (autocast, Newton-Schulz)."""
    return bf16_products().choice == "bfloat16"


@functools.cache
def _bf16_products() -> Decision:
    if not cpu_features().bf16_arithmetic:
        return Decision("bf16_products", "float32", "ruled out",
                        note="no bfloat16 arithmetic (AVX-512 BF16 or AMX): emulated")
    return measured("bf16_products", "float32", "bfloat16", _bf16_options, repr(TRAINING_SHAPES))


def _bf16_options() -> dict[str, Callable[[], object]]:
    generator = torch.Generator().manual_seed(0)
    cases = [(torch.randn(rows, d, generator=generator),
              torch.randn(d_ff, d, generator=generator, requires_grad=True),
              torch.randn(d, d_ff, generator=generator, requires_grad=True),
              torch.randn(4, d, d_ff, generator=generator))
             for rows, d, d_ff in TRAINING_SHAPES]

    def run(dtype: torch.dtype) -> None:
        for x, up, down, stack in cases:
            with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16,
                                                     enabled=dtype == torch.bfloat16):
                y = F.linear(F.silu(F.linear(x, up)), down)  # (rows, d)
                y.float().sum().backward()
            _newton_schulz(stack.to(dtype))

    return {"float32": lambda: run(torch.float32), "bfloat16": lambda: run(torch.bfloat16)}


def _newton_schulz(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's iteration on a stack (n, short, long), as training/optim.py runs it."""
    x = x / x.norm(dim=(-2, -1), keepdim=True)
    for _ in range(steps):
        gram = x @ x.mT  # (n, short, short)
        polynomial = torch.baddbmm(gram, gram, gram, beta=-4.775, alpha=2.0315)
        x = torch.baddbmm(x, polynomial, x, beta=3.4445)
    return x


# ------------------------------------------------------------------- oneDNN against MKL

# ------------------------------------------------------------------------ the kernel build

def kernel_target() -> Decision:
    if os.environ.get("GLASSFORMER_KERNELS", "").lower() == "torch":
        return Decision("kernel_target", "native", "environment",
                        note="GLASSFORMER_KERNELS=torch: no C++ kernels")
    setting = env_setting("GLASSFORMER_KERNEL_TARGET", tuple(build.TARGETS))
    if setting is not None:
        return Decision("kernel_target", setting, "environment",
                        note=f"GLASSFORMER_KERNEL_TARGET={setting}")
    return _kernel_target()


@functools.cache
def _kernel_target() -> Decision:
    if not parse(cpuinfo_text(), "AVX512").avx512:
        return Decision("kernel_target", "native", "ruled out", note="no AVX-512: native is AVX2")
    if torch.backends.cpu.get_cpu_capability() != "AVX512":  # the process computes as AVX2 does
        return Decision("kernel_target", "avx2", "environment",
                        note="PyTorch dispatches to AVX2 (ATEN_CPU_CAPABILITY)")
    if not all(build.built(target) for target in build.TARGETS):
        return Decision("kernel_target", "native", "ruled out",
                        note="only one build is compiled")
    extra = " ".join(build.cache_key(target) for target in build.TARGETS)
    return measured("kernel_target", "native", "avx2", _kernel_options, extra)


def _kernel_options() -> dict[str, Callable[[], object]]:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 576, generator=generator)  # a small model's feed-forward
    qweight, scales = quantize_int8(weight)
    rows = torch.randn(8, 576, generator=generator)  # (8, 576): a decode step's rows
    # (1536, 2 super-blocks of 144 bytes) Q4_K rows of random quants and scales, d = dmin = 2^-7
    q4_k = torch.randint(0, 256, (1536, 2, 144), dtype=torch.uint8, generator=generator)
    q4_k[:, :, 0:4] = torch.tensor([0x00, 0x20, 0x00, 0x20], dtype=torch.uint8)
    q4_k = q4_k.reshape(1536, 288)
    row = torch.randn(1, 512, generator=generator)  # (1, 512): one decode row for the Q4_K rows

    def run(target: str) -> None:
        kernels = build.extension(target)
        for _ in range(16):  # a few milliseconds: long enough that one preemption shows as such
            kernels.linear_q8(rows, qweight, scales, None)
            kernels.linear_f32(rows[:1], weight, None)
            kernels.linear_gguf(row, q4_k, kernels.WeightFormat.q4_k, None)

    return {target: functools.partial(run, target) for target in build.TARGETS}
