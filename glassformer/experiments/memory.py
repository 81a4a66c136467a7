"""Memory at its peak: the process's resident memory from /proc/self (Linux), or what a CUDA
device's allocator held, for work on that device."""

from __future__ import annotations

from pathlib import Path

import torch

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def resident_mb(field: str = "VmRSS") -> float | None:
    """A memory line of /proc/self/status in MB (VmRSS: resident now, VmHWM: its peak); None
    where there is no such file."""
    if not STATUS.exists():
        return None
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return None


def reset_peak_memory(device: str | torch.device = "cpu") -> None:
    """The peak starts again from now: on the CPU from the memory resident now (VmHWM, where
    Linux allows it), on a CUDA device from what its allocator holds now."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        pass


def peak_memory_mb(device: str | torch.device = "cpu") -> float | None:
    """The peak since the last reset in MB: the process's resident memory for work on the CPU,
    the device's allocated memory for a CUDA device."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resident_mb("VmHWM")
