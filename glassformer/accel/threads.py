"""How many threads to compute with on a CPU that other work shares.

PyTorch (and the C++ kernels, which follow `torch.get_num_threads()`) starts one thread per
core. Each parallel region ends at a barrier, so when another process holds one of two
cores, every region waits for the thread that the scheduler parked: decode fell from 78 to
11.5 tokens/s so, against 35.7 on one thread. `ThreadPolicy` counts the cores other
processes leave free (/proc/stat over a window of at least 0.2 s, less this process's own CPU
time, among the cores `os.sched_getaffinity` allows: the command's own start-up, such as loading
its model, fills the window) and computes on that many from `settle()`; `revisit()`, called from
long loops (training steps, the serving engine), counts again over the time since the last
look, at most every `interval` seconds, and applies the count to the calling thread too
(OpenMP keeps it per thread: the engine's stepping thread would otherwise use every core). A
number asked for (`--threads`, GLASSFORMER_THREADS, OMP_NUM_THREADS) is kept as it is.
Torch's thread count belongs to the process, so no library code chooses it on its own: the
process's owner (the command line) makes one ThreadPolicy, settles it before computing and
passes it to `train`, `Engine` and the server, whose loops call its `revisit()` (which settles
it first where that has not happened); without one they leave the count alone.

OpenMP's wait policy is left as it is: with OMP_WAIT_POLICY=PASSIVE (idle threads sleep at
once) a quiet machine decoded int4 2.4x slower, as every small parallel region then waits for
its threads to wake; the thread count alone keeps a busy machine's speed (benchmarks/busy_cpu.py
measures the three).

One team of OpenMP threads at a time. Every thread that runs a parallel region keeps a team of
its own, and once the process holds more OpenMP threads than it has cores, every team's idle
threads sleep at once instead of waiting a moment for the next region: each small product
then waits for its threads to wake. A thread that hands the computing to another one (the
serving engine's stepping thread, started after the model was loaded on the caller's) calls
`hand_over_cores()` first, which ends its own team's threads: on 2 cores, int4 decode on
the engine's thread went from 11.8 to 4.4 ms per token (the caller's team left running
against it ended).
"""

from __future__ import annotations

import os
import time

import torch

from ..errors import InputError
from . import kernels

ENVIRONMENT = ("GLASSFORMER_THREADS", "OMP_NUM_THREADS")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def requested_threads(asked: int | None = None) -> int | None:
    """The thread count asked for: `asked`, else the environment's, else None (choose)."""
    if asked is not None:
        return asked
    for name in ENVIRONMENT:
        text = os.environ.get(name, "").strip()
        if text:
            if not text.isdigit() or int(text) < 1:
                raise InputError(name, f"must be a positive integer, got {text!r}")
            return int(text)
    return None


def allowed_cores() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def snapshot(cores: set[int]) -> tuple[float, float, float]:
    """(seconds busy on `cores` by anyone, seconds this process ran, wall time)."""
    busy = 0
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                    ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
                    busy += sum(ticks) - ticks[3] - ticks[4]
    except OSError:
        busy = 0
    own = os.times()
    return busy / _TICKS, own.user + own.system, time.monotonic()


def free_cores(before, after, cores: int) -> float:
    """Cores left by other processes between two snapshots (busy time of all, less ours)."""
    wall = after[2] - before[2]
    if wall <= 0:
        return float(cores)
    others = max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall
    return max(0.0, cores - others)


def choose_threads(free: float, cores: int) -> int:
    """One thread per core that is free most of the time."""
    return max(1, min(cores, int(free + 0.3)))


def hand_over_cores() -> None:
    """Ends the calling thread's OpenMP team, so that another thread's team has the cores to
    itself; the team starts again if this thread computes again."""
    if kernels.available():
        kernels.release_thread_pool()


class ThreadPolicy:
    """The process's thread count: fixed where asked for, else chosen from the free cores.

    The first choice counts over the time from the policy's making to the first `settle()`
    (at least `window`, the rest waited out): a command makes its policy first and settles it
    once its model is loaded, so the loading fills the window instead of a pause of its own."""

    def __init__(self, asked: int | None = None, interval: float = 10.0, window: float = 0.2):
        self.fixed = requested_threads(asked)
        self.interval, self.window = interval, window
        self.cores = allowed_cores()
        self.threads = self.fixed  # None until settled
        self._last = None if self.fixed is not None else snapshot(self.cores)
        if self.fixed is not None:
            torch.set_num_threads(self.fixed)

    def settle(self) -> int:
        """The count, chosen the first time over the window since the policy was made, applied
        to the calling thread (OpenMP keeps it per thread)."""
        if self.threads is None:
            time.sleep(max(0.0, self.window - (time.monotonic() - self._last[2])))
            now = snapshot(self.cores)
            self.threads, self._last = self._choose(self._last, now), now
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return self.threads

    def revisit(self) -> int:
        """Choose again from the time since the last look, if `interval` has passed (settling
        first where not yet settled)."""
        if self.threads is not None and self.fixed is None \
                and time.monotonic() - self._last[2] >= self.interval:
            now = snapshot(self.cores)
            self.threads, self._last = self._choose(self._last, now), now
        return self.settle()

    def _choose(self, before, after) -> int:
        cores = len(self.cores)
        return choose_threads(free_cores(before, after, cores), cores)

