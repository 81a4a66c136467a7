"""What the recall experiment found (recall.py runs the cells): recall per cell, the claims and
their verdicts, the tables, the depth × length heat maps and the prefill memory curve."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .recall_grid import (
    FACTORS,
    FAR_DEPTHS,
    KEEP,
    KV_POINTS,
    MEMORY_GROWTH,
    NATIVE_GOAL,
    READINGS,
    TASKS,
    depths,
    key,
    lengths,
    native,
)
from .report import save_figure
from .runner import Summary


def recall_at(results: dict, name: str, task: str, reading: str, kv: str, length: int) -> float | None:
    """Share of depths recalled; within the window every reading is `none`'s. None: not run."""
    if length <= native(name):
        reading = "none"
    cell = results.get(key(name, task, reading, kv, length))
    return None if cell is None or cell["skipped"] else float(np.mean(cell["hits"]))


def _pooled(results: dict, name: str, reading: str, kv: str, length: int) -> float | None:
    values = [recall_at(results, name, t, reading, kv, length) for t in TASKS]
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def claims(config: dict, results: dict) -> list[dict]:
    out = []
    for name in config["models"]:
        n = native(name)
        base = recall_at(results, name, "needle", "none", "fp32", n)
        out.append({"claim": f"{name}: the needle is found at the native window ({n} tokens), no "
                             f"scaling, fp32 KV (held: ≥ {NATIVE_GOAL:.0%} over the depths)",
                    "held": None if base is None else base >= NATIVE_GOAL,
                    "evidence": "not measured within the budget" if base is None else
                                f"{base:.0%} of {config['depths']} depths" + _misses(results, name, n)})
        fp32 = _pooled(results, name, "none", "fp32", n)
        for kv in config["kv_dtypes"]:
            if kv == "fp32":
                continue
            other = _pooled(results, name, "none", kv, n)
            held = None if fp32 is None or other is None or fp32 < 0.5 else fp32 - other <= KV_POINTS
            out.append({"claim": f"{name}: the {kv} KV cache keeps recall within "
                                 f"{KV_POINTS * 100:.0f} points of fp32 at the native window",
                        "held": held,
                        "evidence": "not measured within the budget" if other is None or fp32 is None
                        else f"{other:.0%} against {fp32:.0%} (needle and multi-key pooled)"
                        + ("; inconclusive below 50% with fp32: nothing to lose" if fp32 < 0.5 else "")})
        out += [_keeps(results, name, reading) for reading in READINGS]
        out += [_at_factor(results, name, f) for f in FACTORS]
        out.append(_linear_memory(results, name))
    return out


def prefill_memory(results: dict, name: str, kv: str = "fp32") -> list[tuple[int, float, float]]:
    """(L, peak MB, median prefill seconds) of `name`'s needle cells read as trained (`none`)
    with `kv`, shortest first, from the device that ran the longest of them (a CPU's resident
    memory and a GPU's allocations are not one curve); cells without the figures are left out."""
    wanted = (name, "needle", "none", kv)
    cells = sorted((c for c in results.values()
                    if (c.get("model"), c.get("task"), c.get("reading"), c.get("kv")) == wanted
                    and not c["skipped"] and c.get("peak_mb")), key=lambda c: c["length"])
    device = cells[-1].get("device") if cells else None
    return [(c["length"], c["peak_mb"], float(np.median(c["prefill_seconds"])))
            for c in cells if c.get("device") == device]


def _linear_memory(results: dict, name: str) -> dict:
    """Held when the peak grows per token between the two longest prompts by at most
    MEMORY_GROWTH times what it grew between the two before (quadratic attention memory would
    double it at every doubling of L)."""
    points = prefill_memory(results, name)
    claim = (f"{name}: a long prefill's peak memory grows linearly with the prompt (held: the "
             f"growth per token between the two longest prompts ≤ {MEMORY_GROWTH}× that before)")
    if len(points) < 3:
        return {"claim": claim, "held": None, "evidence": "fewer than 3 lengths measured"}
    (a, ma, _), (b, mb, _), (c, mc, _) = points[-3:]
    before, last = (mb - ma) / (b - a), (mc - mb) / (c - b)
    return {"claim": claim, "held": last <= MEMORY_GROWTH * max(before, 0.0),
            "evidence": f"peak {ma:.0f}, {mb:.0f}, {mc:.0f} MB at {a}, {b}, {c} tokens: "
                        f"{before * 2**20 / 1e3:.0f} then {last * 2**20 / 1e3:.0f} KB per token"}


def _misses(results: dict, name: str, length: int) -> str:
    cell = results[key(name, "needle", "none", "fp32", length)]
    missed = [f"{d:.0%}" for d, hit in zip(cell["depths"], cell["hits"], strict=True) if not hit]
    return f"; missed at depths {', '.join(missed)}" if missed else ""


def _against_native(results: dict, name: str, reading: str, length: int) -> tuple[float, float] | None:
    """(recall at `length` read by `reading`, recall at the window read as trained), each pooled
    over the tasks measured at both, fp32 KV. None: no such pair measured."""
    pairs = [(recall_at(results, name, t, reading, "fp32", length),
              recall_at(results, name, t, "none", "fp32", native(name))) for t in TASKS]
    pairs = [pair for pair in pairs if None not in pair]
    return tuple(float(np.mean(v)) for v in zip(*pairs, strict=True)) if pairs else None


def verdict(results: dict, name: str, reading: str, factor: int) -> str:
    """kept (≥ KEEP of the native recall), lost, inconclusive (native below 50%) or not measured."""
    pair = _against_native(results, name, reading, factor * native(name))
    if pair is None:
        return "not measured"
    far, near = pair
    return "inconclusive" if near < 0.5 else "kept" if far >= KEEP * near else "lost"


def _keeps(results: dict, name: str, reading: str) -> dict:
    n = native(name)
    far = {f: _against_native(results, name, reading, f * n) for f in FACTORS}
    measured = {f: pair for f, pair in far.items() if pair is not None}
    claim = (f"{name}: {reading} keeps recall past the window (held: at every measured 2×/4×/8×, "
             f"≥ {KEEP:.0%} of the native recall)")
    if not measured:
        return {"claim": claim, "held": None, "evidence": "not measured within the budget"}
    judged = {f: verdict(results, name, reading, f) for f in measured}
    evidence = ", ".join(f"{a:.0%} at {f}× against {b:.0%}" for f, (a, b) in measured.items())
    if "inconclusive" in judged.values():
        return {"claim": claim, "held": None,
                "evidence": f"{evidence}; native recall below 50%: nothing to keep"}
    return {"claim": claim, "held": all(v == "kept" for v in judged.values()),
            "evidence": f"{evidence} at the window"}


def _at_factor(results: dict, name: str, factor: int) -> dict:
    """Which readings keep recall at `factor` windows, which lose it, which were not measured."""
    judged = {r: verdict(results, name, r, factor) for r in READINGS}
    groups = {v: [r for r in READINGS if judged[r] == v] for v in
              ("kept", "lost", "inconclusive", "not measured")}
    claim = (f"{name}: at {factor}× the window ({factor * native(name)} tokens) a reading keeps recall "
             f"(held: ≥ {KEEP:.0%} of the native recall, the tasks measured at both pooled)")
    held = True if groups["kept"] else False if groups["lost"] else None
    return {"claim": claim, "held": held,
            "evidence": "; ".join(f"{v}: {', '.join(rs)}" for v, rs in groups.items() if rs)}


def summarize(config: dict, results: dict, out: Path) -> Summary:
    rows, figures = [], []
    union = sorted({L for n in config["models"] for L in _lengths(config, n)})
    for name in config["models"]:
        grid = _lengths(config, name)
        for task in TASKS:
            for reading, kv in _readings(config, results, name):
                rows.append([name, task, f"{reading} {kv}",
                             *(recall_at(results, name, task, reading, kv, L) if L in grid else None
                               for L in union)])
            file = save_figure(out, f"recall_{name}_{task}.png",
                               lambda fig, n=name, t=task: _draw(fig, config, results, n, t),
                               size=(12, 6.5))
            figures.append({"file": file, "caption": f"{name}, {task}: recalled (green) or not (red) "
                            f"by depth and length; the dotted line is the {native(name)}-token window, "
                            "grey: not run"})
    if any(prefill_memory(results, name, kv) for name in config["models"] for kv in config["kv_dtypes"]):
        figures.append({"file": save_figure(out, "prefill_memory.png",
                                            lambda fig: _draw_prefill(fig, config, results)),
                        "caption": "peak memory (of the device that ran the longest prompt) and "
                                   "prefill time against prompt length (needle prompts, read as "
                                   "trained), per KV dtype; the memory holds the model too"})
    table = {"title": "Recall (share of depths) against prompt length", "rows": rows,
             "columns": ["model", "task", "reading", *(f"L={L}" for L in union)],
             "note": f"{config['depths']} depths per cell; within the window every reading is "
                     "'none' with that KV dtype; a dash: not run (past the budget, or no such "
                     "length for the model)"}
    verdicts = {"title": f"Past the window: recall kept (≥ {KEEP:.0%} of the native) or lost",
                "columns": ["model", "reading", *(f"{f}×" for f in FACTORS)],
                "rows": [[name, reading, *(_judged(results, name, reading, f) for f in FACTORS)]
                         for name in config["models"] for reading in READINGS],
                "note": "fp32 KV; recall pooled over the tasks measured both there and at the window "
                        f"(read as trained); {min(FAR_DEPTHS, config['depths'])} depths per cell past "
                        f"the window; retrieve's prompt holds at most {config['retrieve_tokens']} "
                        "tokens (or the window)"}
    return Summary(tables=[table, verdicts], figures=figures, claims=claims(config, results))


def _judged(results: dict, name: str, reading: str, factor: int) -> str:
    pair = _against_native(results, name, reading, factor * native(name))
    word = verdict(results, name, reading, factor)
    return word if pair is None else f"{word} ({pair[0]:.0%} against {pair[1]:.0%})"


def _lengths(config: dict, name: str) -> list[int]:
    return lengths(name, config["max_length"], config["min_length"])


def _readings(config: dict, results: dict, name: str) -> list[tuple[str, str]]:
    """The readings of `name` measured in cells of their own (within the window all are none's)."""
    planned = [(r, "fp32") for r in READINGS] + [("none", kv) for kv in config["kv_dtypes"] if kv != "fp32"]
    return [(r, kv) for r, kv in planned if any(
        c.get("model") == name and c.get("reading") == r and c.get("kv") == kv and not c["skipped"]
        for c in results.values())]


def _draw(fig, config: dict, results: dict, name: str, task: str) -> None:
    grid, rows = _lengths(config, name), depths(config)
    readings = _readings(config, results, name) or [("none", "fp32")]
    axes = fig.subplots(1 + (len(readings) > 3), -(-len(readings) // 2) if len(readings) > 3
                        else len(readings), squeeze=False).ravel()
    for ax, (reading, kv) in zip(axes, readings, strict=False):
        image = np.full((len(rows), len(grid)), np.nan)
        for j, L in enumerate(grid):
            cell = results.get(key(name, task, "none" if L <= native(name) else reading, kv, L))
            if cell and not cell["skipped"]:  # past the window, fewer depths: the rest grey
                at = [int(np.argmin(np.abs(np.asarray(rows) - d))) for d in cell["depths"]]
                image[at, j] = cell["hits"]
        ax.imshow(image, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", origin="upper")
        ax.set_facecolor("#ccc")
        ax.set_xticks(range(len(grid)), [f"{L // 1024}k" if L >= 1024 else str(L) for L in grid],
                      fontsize=6)
        ax.set_yticks(range(len(rows)), [f"{d:.0%}" for d in rows], fontsize=6)
        window = sum(L <= native(name) for L in grid) - 0.5
        ax.axvline(window, color="black", linestyle=":")
        ax.set_title(f"{reading} {kv}", fontsize=8)
    for ax in axes[len(readings):]:
        ax.set_visible(False)  # an odd count leaves one
    fig.supxlabel("prompt length (tokens)", fontsize=8)
    fig.supylabel("needle depth", fontsize=8)


def _draw_prefill(fig, config: dict, results: dict) -> None:
    memory, seconds = fig.subplots(1, 2)
    for name in config["models"]:
        for kv in config["kv_dtypes"]:
            points = prefill_memory(results, name, kv)
            if points:
                lengths_, peaks, times = zip(*points, strict=True)
                memory.plot(lengths_, peaks, marker="o", label=f"{name} {kv}")
                seconds.plot(lengths_, times, marker="o", label=f"{name} {kv}")
    for ax, label in ((memory, "peak memory (MB)"), (seconds, "prefill (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(label)
        ax.legend(fontsize=6)
