"""What this CPU computes fast: its vector features, and the decisions that follow from them.

Features come from the kernel's flags (/proc/cpuinfo) capped by the instruction set PyTorch
dispatches to (`torch.backends.cpu.get_cpu_capability()`, which ATEN_CPU_CAPABILITY=avx2
lowers): AVX-512 that PyTorch will not use counts as absent. The decisions are known, not
assumed per vendor: a bfloat16 matrix product pays only with bfloat16 arithmetic in hardware
(AVX-512 BF16 or AMX); without it PyTorch emulates it, 10-20× slower than float32
(benchmarks/newton_schulz.py measures both). `GLASSFORMER_BF16=0/1` overrides the decision.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

# /proc/cpuinfo flag names of the features that choose a fast path.
_FLAGS = {"avx2": "avx2", "fma": "fma", "avx512": "avx512f", "avx512_bf16": "avx512_bf16",
          "avx512_vnni": "avx512_vnni", "avx_vnni": "avx_vnni", "amx": "amx_tile"}


@dataclass(frozen=True)
class CpuFeatures:
    model: str
    avx2: bool = False
    fma: bool = False
    avx512: bool = False
    avx512_bf16: bool = False
    avx512_vnni: bool = False
    avx_vnni: bool = False
    amx: bool = False

    @property
    def vnni(self) -> bool:
        return self.avx512_vnni or self.avx_vnni

    @property
    def bf16_arithmetic(self) -> bool:
        """bfloat16 products in hardware: AVX-512 BF16 or AMX."""
        return self.avx512_bf16 or self.amx

    def summary(self) -> str:
        """One line: the model and which of the deciding features it has."""
        names = [("AVX2", self.avx2), ("AVX-512", self.avx512), ("AVX-512 BF16", self.avx512_bf16),
                 ("AMX", self.amx), ("VNNI", self.vnni)]
        return f"{self.model}: " + ", ".join(f"{n} {'yes' if has else 'no'}" for n, has in names)


def parse(cpuinfo: str, capability: str) -> CpuFeatures:
    """The features named by /proc/cpuinfo's text, as far as `capability` (PyTorch's
    dispatch level: "AVX512", "AVX2", "DEFAULT", ...) lets them be used."""
    fields = _first_processor(cpuinfo)
    model = fields.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:  # a virtual machine may name no model
        model += f" (family {fields['cpu family']}, model {fields['model']})"
    flags = set(fields.get("flags", "").split())
    found = {name: flag in flags for name, flag in _FLAGS.items()}
    if capability != "AVX512":
        found.update(avx512=False, avx512_bf16=False, avx512_vnni=False, amx=False)
    if capability not in ("AVX512", "AVX2"):
        found.update(avx2=False, fma=False, avx_vnni=False)
    return CpuFeatures(model=model, **found)


def _first_processor(cpuinfo: str) -> dict[str, str]:
    """The first processor's `key : value` lines of /proc/cpuinfo's text."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, colon, value = line.partition(":")
        if colon and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's features, read once per process."""
    return parse(cpuinfo_text(), torch.backends.cpu.get_cpu_capability())


@functools.cache
def cpuinfo_text() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return info.read()
    except OSError:
        return ""


def choose_kernel_target(has_avx512: bool, capability: str) -> str:
    """The build of the C++ kernels to use: "native", or "avx2" where PyTorch dispatches below
    the AVX-512 this CPU has (ATEN_CPU_CAPABILITY=avx2), so that the kernels too compute as an
    AVX2-only CPU does."""
    return "avx2" if has_avx512 and capability != "AVX512" else "native"


@functools.cache
def kernel_target() -> str:
    """This process's kernel build (see choose_kernel_target), decided once."""
    has_avx512 = parse(cpuinfo_text(), "AVX512").avx512
    return choose_kernel_target(has_avx512, torch.backends.cpu.get_cpu_capability())


def bf16_products_pay(features: CpuFeatures | None = None) -> bool:
    """Whether bfloat16 matrix products beat float32 ones on this CPU."""
    setting = os.environ.get("GLASSFORMER_BF16", "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    return (features or cpu_features()).bf16_arithmetic
