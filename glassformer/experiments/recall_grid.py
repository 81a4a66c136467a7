"""The recall experiment's grid (recall.py runs it, recall_findings.py judges it): the models and
their windows, the tasks, the readings past the window, the prompt lengths and needle depths,
each cell's key, and the thresholds the claims are judged by."""

from __future__ import annotations

import math

from ..generation.context_extension import EXTENSIONS

# each model's window N and its shortest prompt (a multi-key prompt must fit in it)
MODELS = {"smollm2-135m-instruct": (8192, 256), "shakespeare-rope": (512, 512)}
SMALL = "shakespeare-rope"  # the length experiment's RoPE model, trained here at a 512 window
TASKS = {"needle": 1, "multikey": 4}  # needles hidden per prompt
READINGS = (*EXTENSIONS, "window", "sink", "retrieve")
FACTORS = (2, 4, 8)  # lengths past the window, in windows
FAR_DEPTHS = 3  # depths per cell past the window
NATIVE_GOAL, KV_POINTS, KEEP = 0.9, 0.05, 0.9
MEMORY_GROWTH = 1.5


def native(name: str) -> int:
    return MODELS[name][0]


def lengths(name: str, max_length: int | None, min_length: int | None = None) -> list[int]:
    """Powers of two from the model's shortest prompt up to 8× its window (at most `max_length`;
    from `min_length` on, the window itself kept)."""
    n, first = MODELS[name]
    out = [2**k for k in range(int(math.log2(first)), int(math.log2(n * FACTORS[-1])) + 1)]
    return [L for L in out if (max_length is None or L <= max_length)
            and (min_length is None or L >= min_length or L == n)]


def depths(config: dict, past_window: bool = False) -> list[float]:
    count = min(FAR_DEPTHS, config["depths"]) if past_window else config["depths"]
    return [i / (count - 1) for i in range(count)]


def key(name: str, task: str, reading: str, kv: str, length: int) -> str:
    return f"{name}/{task}/{reading}/{kv}/{length}"
