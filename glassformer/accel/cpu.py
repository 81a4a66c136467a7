"""What this CPU has: its vector features, as PyTorch dispatches to them.

Features come from the kernel's flags (/proc/cpuinfo) capped by the instruction set PyTorch
dispatches to (`torch.backends.cpu.get_cpu_capability()`, which ATEN_CPU_CAPABILITY=avx2
lowers): AVX-512 that PyTorch will not use counts as absent. Flags rule a fast path out (no
bfloat16 arithmetic: PyTorch would emulate it), never in: what pays is measured on the
machine (decisions.py).
"""

from __future__ import annotations

import functools
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


def cpu_identity() -> str:
    """The first processor's model, family, model number and flags: what names this CPU in the
    records of measured decisions (decisions.py)."""
    fields = _first_processor(cpuinfo_text())
    keys = ("model name", "cpu family", "model", "flags")
    return "\n".join([platform.machine(), platform.processor(), *(fields.get(k, "") for k in keys)])
