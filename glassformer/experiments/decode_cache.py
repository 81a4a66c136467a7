"""cache: the time of one decode step against the context length, with and without a KV cache.

Without a cache, the step at context L runs the model over all L tokens again; with one, it
runs one token against L cached keys and values. Per token the first grows about linearly
with L (so a whole generation grows quadratically) and the second stays nearly flat (the
generation grows linearly), at the price of the cache's memory: 2 · layers · kv_heads ·
d_head numbers per token. Timings are medians of a few repeats; past the two shortest lengths
(a growth needs two points, and they cost little), lengths whose expected cost would overrun
the model's share of the budget are skipped and marked so.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch

from ..errors import InputError
from ..model.kv_cache import KVCache
from ..model.transformer import Transformer
from .report import save_figure
from .runner import Cell, Context, Summary
from .stats import growth_exponent
from .timed import base_model

NEEDS_DATA = False
TITLE = "KV cache: decode cost against context length"
LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048)
MODELS = ("tiny", "smollm2-135m-instruct")
STEPS = 4  # cached decode steps timed per length
TINY_SHARE = 0.2  # of the budget; the rest goes to SmolLM2
GROWTH_PER_DOUBLING = 2.5  # to plan the budget: between linear layers (2) and attention (4)


def settings(budget: float, models=MODELS) -> dict:
    unknown = sorted(set(models) - set(MODELS))
    if unknown or not models:
        raise InputError("models", f"choose among {', '.join(MODELS)}; got {unknown or 'none'}")
    return {"budget": budget, "models": list(models), "repeats": 3 if budget >= 60 else 1}


def cells(config: dict) -> list[Cell]:
    loaded: dict[str, Transformer] = {}  # each model loaded once per process, for all lengths
    return [Cell(f"{name}/{length}", _time_cell(name, length, loaded), f"{name} at {length}")
            for name in config["models"] for length in LENGTHS]


def _model(name: str, loaded: dict[str, Transformer]) -> Transformer:
    if name not in loaded:
        if name == "tiny":  # the shakespeare-char shape, random weights, a 2048-token window
            torch.manual_seed(0)
            loaded[name] = Transformer(base_model().replace(position="rope", context_length=2048))
        else:
            from ..language_model import load

            loaded[name] = load(name, progress=False).model
        model = loaded[name].eval()
        with torch.no_grad():  # first calls pay one-time costs: keep them off every clock
            cache = KVCache(model.config, batch_size=1, max_length=16)
            model.forward_hidden(torch.zeros(1, 8, dtype=torch.long), cache)
            model.forward_hidden(torch.zeros(1, 1, dtype=torch.long), cache)
    return loaded[name]


def _share(config: dict, name: str) -> float:
    if len(config["models"]) == 1:
        return config["budget"]
    return config["budget"] * (TINY_SHARE if name == "tiny" else 1 - TINY_SHARE)


def _time_cell(name: str, length: int, loaded: dict[str, Transformer]):
    def run(ctx: Context) -> dict:
        spent = sum(r["cell_seconds"] for r in ctx.results.values() if r["model"] == name)
        done = [r for r in ctx.results.values() if r["model"] == name and not r["skipped"]]
        if len(done) >= 2:  # per doubling of L: about 2x (linear layers) to 4x (attention)
            last = done[-1]
            growth = GROWTH_PER_DOUBLING ** math.log2(length / last["length"])
            expected = (ctx.settings["repeats"] + 1) * last["uncached_seconds"] * growth
            if spent + expected > _share(ctx.settings, name):
                return {"model": name, "length": length, "skipped": True}
        model = _model(name, loaded)
        with torch.no_grad():
            return {"model": name, "length": length, "skipped": False,
                    **measure(model, length, ctx.settings["repeats"])}

    return run


def measure(model: Transformer, length: int, repeats: int) -> dict:
    """Seconds of one decode step at context `length` without a cache (the whole context
    again) and with one (a single token against length - 1 cached positions), and the bytes
    the cache holds at that length."""
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=generator)  # (1, L)
    uncached = []
    for _ in range(repeats):
        started = time.perf_counter()
        model.head(model.forward_hidden(ids)[:, -1])  # next-token logits (1, vocab)
        uncached.append(time.perf_counter() - started)
    cache = KVCache(model.config, batch_size=1, max_length=length)
    first = max(length - STEPS, 1)
    model.forward_hidden(ids[:, :first], cache)  # prefill, not timed
    cached = []
    for position in range(first, length):
        started = time.perf_counter()
        model.head(model.forward_hidden(ids[:, position : position + 1], cache)[:, -1])
        cached.append(time.perf_counter() - started)
    cache_bytes = sum(t.nbytes for t in cache.keys + cache.values)
    return {"uncached_seconds": statistics.median(uncached),
            "cached_seconds": statistics.median(cached), "cache_bytes": cache_bytes,
            "cache_bytes_per_token": cache_bytes // length}


def summarize(config: dict, results: dict[str, dict], out: Path) -> Summary:
    measured = [r for r in results.values() if not r["skipped"]]
    rows = [[r["model"], r["length"], r["uncached_seconds"] * 1e3, r["cached_seconds"] * 1e3,
             r["uncached_seconds"] / r["cached_seconds"], r["cache_bytes"] / 2**20] for r in measured]
    skipped = [f"{r['model']} at {r['length']}" for r in results.values() if r["skipped"]]
    table = {"title": "One decode step", "rows": rows,
             "columns": ["model", "context", "no cache (ms)", "KV cache (ms)", "speed-up",
                         "cache (MiB)"],
             "note": f"median of {config['repeats']} uncached and {STEPS} cached steps; float32. "
                     + (f"Skipped for the budget: {', '.join(skipped)}." if skipped else "")}
    fits, claims = [], []
    for name in config["models"]:
        mine = [r for r in measured if r["model"] == name]
        if len(mine) < 2:
            claims.append({"claim": f"{name}: the KV cache turns quadratic decode into linear",
                           "held": None, "evidence": "fewer than two lengths fit the budget"})
            continue
        lengths = [r["length"] for r in mine]
        slow = growth_exponent(lengths, [r["uncached_seconds"] for r in mine])
        fast = growth_exponent(lengths, [r["cached_seconds"] for r in mine])
        fits.append([name, slow, fast, mine[-1]["cache_bytes_per_token"]])
        claims.append({
            "claim": f"{name}: the KV cache turns quadratic decode into linear",
            "held": slow > 0.7 and fast < 0.5,
            "evidence": f"per-token time grows as L^{slow:.2f} without the cache (a generation: "
                        f"L^{slow + 1:.2f}) and L^{fast:.2f} with it (L^{fast + 1:.2f}), fitted on "
                        f"the longer half of {lengths[0]}…{lengths[-1]} (held: above 0.7 "
                        "and below 0.5)"})
    fit_table = {"title": "Fitted growth of the per-token time, t ∝ L^p", "rows": fits,
                 "columns": ["model", "p without cache", "p with cache", "cache bytes/token"]}
    figure = save_figure(out, "cache_decode.png", lambda fig: _draw(fig, measured), size=(10, 4))
    return Summary(tables=[table, fit_table], claims=claims,
                   figures=[{"file": figure, "caption": "Left: seconds per decode step against "
                             "context length. Right: the cache's memory."}])


def _draw(fig, measured: list[dict]) -> None:
    time_ax, memory_ax = fig.subplots(1, 2)
    for name in dict.fromkeys(r["model"] for r in measured):
        mine = [r for r in measured if r["model"] == name]
        lengths = [r["length"] for r in mine]
        time_ax.plot(lengths, [r["uncached_seconds"] for r in mine], "o-", label=f"{name}, no cache")
        time_ax.plot(lengths, [r["cached_seconds"] for r in mine], "s--", label=f"{name}, KV cache")
        memory_ax.plot(lengths, [r["cache_bytes"] / 2**20 for r in mine], "o-", label=name)
    for ax, label in ((time_ax, "seconds per token"), (memory_ax, "KV cache (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
