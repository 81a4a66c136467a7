"""The process's resident memory from /proc/self (Linux): now, at its peak, and a new peak."""

from __future__ import annotations

from pathlib import Path

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


def reset_peak_memory() -> None:
    """The peak (VmHWM) starts again from the memory resident now, where Linux allows it."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        pass


def peak_memory_mb() -> float | None:
    return resident_mb("VmHWM")
