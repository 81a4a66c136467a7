"""The machine every benchmark figure comes from, printed by each script beside its figures:
the CPU model, the vector features that choose the fast paths (glassformer/accel/cpu.py),
PyTorch's dispatch level, the threads, and how busy the cores are right now ("loaded" when
other processes hold more than a fifth of a core: the figures are then a busy machine's).
"""

from __future__ import annotations

import sys
import time

from glassformer.accel import threads
from glassformer.accel.cpu import cpu_features


def cpu_line(window: float = 0.2) -> str:
    import torch

    cores = threads.allowed_cores()
    before = threads.snapshot(cores)
    time.sleep(window)
    free = threads.free_cores(before, threads.snapshot(cores), len(cores))
    busy = len(cores) - free
    return (f"CPU {cpu_features().summary()}; dispatch {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads on {len(cores)} cores, others using {busy:.1f} "
            f"({'loaded' if busy > 0.2 else 'quiet'} machine)")


def print_cpu(json_mode: bool = False) -> None:
    """The line on stdout, or on stderr where stdout carries one JSON object."""
    print(cpu_line(), file=sys.stderr if json_mode else sys.stdout, flush=True)
