"""recall: can the model find a fact in a long text? Needle in a haystack, and multi-key.

A secret number (recall_tasks.py) is hidden at depths 0–100% of Shakespeare, in prompts of
L tokens (the answer's tokens included) from 256 up to 8× the model's window; the question
comes last, and the answer counts when the number appears in the first line of the greedy
continuation (a multi-key answer often goes on to list the other needles).
Multi-key hides four needles and asks for one. Each (model, task, reading, KV dtype, L) is
one cell over every depth, run through the serving engine with that KV dtype. A reading is
how a text longer than the window is read:
- none: RoPE as trained, positions past the window; linear, ntk, yarn: RoPE rescaled by L/N;
- window: sliding-window attention over the last N tokens (N: the model's window);
- retrieve: the best chunks that fit the window, by BM25 and the model's embedding
  (generation/retrieval.py).
Within the window every reading is the same computation, so only `none` runs there, with
every KV dtype of the pool (KV_DTYPES). Lengths run shortest first; once one cell of a model
is done, a cell whose expected time (the last one's, grown as L^1.5) would overrun the
model's share of the budget is skipped and marked so.
Each cell also records the prefill time of each prompt and the process's peak resident memory
while it ran (reset before it, where /proc/self/clear_refs allows): prompts grow cell by
cell, so the peak against L shows how the memory of a long prefill grows (chunked prefill, the
flash kernel: linearly), and with each KV dtype at the window.
"""

from __future__ import annotations

import math
import random
import typing
from pathlib import Path

import numpy as np
import torch

from ..generation.config import GenerationResult, RequestParams
from ..generation.context_extension import extend_context
from ..generation.retrieval import retrieve
from ..model.config import RopeScaling
from ..model.sink import SinkPolicy
from ..model.transformer import Transformer
from ..serving.engine import Engine, EngineConfig
from ..serving.kv_pool import KV_DTYPES
from .memory import peak_memory_mb, reset_peak_memory
from .recall_tasks import frame, haystack_prompt, needles, recalled, spells_digits
from .report import save_figure
from .runner import Cell, Context, Summary
from .timed import base_model, train_config, train_timed

NEEDS_DATA = True
TITLE = "Recall: finding a fact in a long context"
# each model's window N and its shortest prompt (a multi-key prompt must fit in it)
MODELS = {"smollm2-135m-instruct": (8192, 256), "shakespeare-rope": (512, 512)}
SMALL = "shakespeare-rope"  # the length experiment's RoPE model, trained here at a 512 window
SMALL_SHARE = 0.1  # of the budget, its training included
MAX_TRAIN_SECONDS = 600.0
TASKS = {"needle": 1, "multikey": 4}  # needles hidden per prompt
READINGS = (*typing.get_args(RopeScaling), "window", "sink", "retrieve")
SINK_TOKENS = 4  # sink: the first 4 tokens kept, and the latest (window - 4)
FACTORS = (2, 4, 8)  # lengths past the window, in windows
ANSWER_TOKENS = 24  # greedy tokens per answer (a spelled number needs about 20 characters)
CHUNK_TOKENS = 128
NATIVE_GOAL, KV_POINTS, KEEP = 0.9, 0.05, 0.9
MEMORY_GROWTH = 1.5


def settings(budget: float, data: Path, models=tuple(MODELS), max_length: int | None = None) -> dict:
    unknown = sorted(set(models) - set(MODELS))
    if unknown or not models:
        raise ValueError(f"models: choose among {', '.join(MODELS)}; got {unknown or 'none'}")
    if max_length is not None and max_length < 256:
        raise ValueError(f"max_length: at least 256 tokens, got {max_length}")
    return {"budget": budget, "data": str(data), "models": list(models), "max_length": max_length,
            "depths": 11 if budget >= 3600 else 5 if budget >= 60 else 3, "kv_dtypes": list(KV_DTYPES),
            "train_seconds": round(min(max(SMALL_SHARE * budget / 2, 1.0), MAX_TRAIN_SECONDS), 2)}


def native(name: str) -> int:
    return MODELS[name][0]


def lengths(name: str, max_length: int | None) -> list[int]:
    """Powers of two from the model's shortest prompt up to 8× its window (at most `max_length`)."""
    n, first = MODELS[name]
    out = [2**k for k in range(int(math.log2(first)), int(math.log2(n * FACTORS[-1])) + 1)]
    return [L for L in out if max_length is None or L <= max_length]


def depths(config: dict) -> list[float]:
    return [i / (config["depths"] - 1) for i in range(config["depths"])]


def cells(config: dict) -> list[Cell]:
    loaded: dict[str, tuple] = {}  # each model (and its haystack) loaded once per process
    out = [Cell(f"train/{SMALL}", _train_cell, f"train {SMALL}")] if SMALL in config["models"] else []
    for name in config["models"]:
        for length in lengths(name, config["max_length"]):
            for task in TASKS:
                readings = [(r, "fp32") for r in READINGS] if length > native(name) else \
                           [("none", kv) for kv in config["kv_dtypes"]]
                out += [Cell(key(name, task, r, kv, length), _recall_cell(name, task, r, kv, length, loaded),
                             f"{name} {task} {r} {kv} at {length}") for r, kv in readings]
    return out


def key(name: str, task: str, reading: str, kv: str, length: int) -> str:
    return f"{name}/{task}/{reading}/{kv}/{length}"


def _train_cell(ctx: Context) -> dict:
    folder = ctx.folder(f"train/{SMALL}")
    config = base_model().replace(position="rope", context_length=native(SMALL))
    summary = train_timed(ctx.settings["data"], folder, config,
                          train_config(ctx.settings["train_seconds"], seed=0))
    for state in folder.glob("step-*/training_state.safetensors"):
        state.unlink()
    return {"model": SMALL, "iters": summary["iters"], "val_loss": summary["val_loss"]}


def _model(ctx: Context, name: str, loaded: dict) -> tuple:
    """(model, tokenizer, haystack ids) of `name`, loaded once."""
    if name not in loaded:
        if name == SMALL:
            from ..formats.checkpoint import load_model

            model, tokenizer, _ = load_model(ctx.kept(f"train/{SMALL}"))
        else:
            from ..language_model import load

            language_model = load(name, progress=False)
            model, tokenizer = language_model.model, language_model.tokenizer
        longest = native(name) * FACTORS[-1]
        text = Path(ctx.settings["data"]).read_text(encoding="utf-8")[: 6 * longest]
        loaded[name] = (model.eval(), tokenizer, tokenizer.encode(text))
    return loaded[name]


def reader(model: Transformer, reading: str, length: int) -> Transformer:
    """The model that reads `length` tokens the way `reading` does (retrieve and sink: the
    model itself; sink is the engine's cache policy)."""
    n = model.config.context_length
    if length <= n or reading in ("retrieve", "sink"):
        return model
    if reading == "window":
        wide = Transformer(model.config.replace(context_length=length, sliding_window=n))
        wide.load_state_dict(model.state_dict(), strict=True, assign=True)
        if model.config.tie_embeddings:
            wide.lm_head.weight = wide.embed.tokens.weight
        return wide.eval()
    return extend_context(model, reading, length / n).eval()


def prompts(tokenizer, hay: list[int], task: str, length: int, grid: list[float]) -> list:
    """One prompt per depth; the needles (and the other needles' depths) are drawn from a seed
    that names the task, length and depth, so every reading and KV dtype meets the same ones."""
    spelled, out = spells_digits(tokenizer), []
    for depth in grid:
        rng = random.Random(f"{task}/{length}/{depth:.3f}")
        hidden = needles(rng.randrange(2**31), TASKS[task], spelled)
        where = [depth] + [rng.random() for _ in hidden[1:]]
        out.append(haystack_prompt(tokenizer, hay, hidden, where, length - ANSWER_TOKENS))
    return out


def answers(model: Transformer, tokenizer, prompt_ids: list[list[int]], kv_dtype: str,
            sink: SinkPolicy | None = None) -> list[GenerationResult]:
    """Greedy answers, one request at a time through the engine with `kv_dtype` pool (and the
    attention-sink policy `sink`, which reads past the window)."""
    longest = max(len(p) for p in prompt_ids) + ANSWER_TOKENS
    engine = Engine(model, tokenizer, EngineConfig(
        kv_dtype=kv_dtype, n_blocks=-(-longest // 16) + 1, block_size=16, max_batch=1,
        token_budget=512, prefix_caching=False, batch_invariant=False, sink=sink))
    params = RequestParams(max_new_tokens=ANSWER_TOKENS, stop=("\n",))  # the answer's first line
    handles = [engine.submit(p, params) for p in prompt_ids]
    engine.run_until_done()
    return [h.wait(0) for h in handles]


def _recall_cell(name: str, task: str, reading: str, kv: str, length: int, loaded: dict):
    def run(ctx: Context) -> dict:
        done = [r for k, r in ctx.results.items() if k.startswith(f"{name}/") and not r["skipped"]]
        spent = sum(r["cell_seconds"] for k, r in ctx.results.items() if k.startswith(f"{name}/"))
        base = {"model": name, "task": task, "reading": reading, "kv": kv, "length": length}
        if done:
            last = done[-1]
            expected = last["cell_seconds"] * max(length / last["length"], 1.0) ** 1.5
            if spent + expected > _share(ctx.settings, name):
                return base | {"skipped": True}
        model, tokenizer, hay = _model(ctx, name, loaded)
        grid = depths(ctx.settings)
        asked = prompts(tokenizer, hay, task, length, grid)
        ids = [p.ids for p in asked]
        if reading == "retrieve" and length > model.config.context_length:
            ids = [_retrieved(model, tokenizer, p) for p in asked]
        n = model.config.context_length
        sink = SinkPolicy(SINK_TOKENS, n - SINK_TOKENS) if reading == "sink" and length > n else None
        reset_peak_memory()
        with torch.no_grad():
            results = answers(reader(model, reading, length), tokenizer, ids, kv, sink)
        texts = [r.text for r in results]
        return base | {"skipped": False, "depths": grid, "answers": texts,
                       "expected": [p.asked.value for p in asked],
                       "hits": [recalled(t, p.asked) for t, p in zip(texts, asked, strict=True)],
                       "prompt_tokens": [len(i) for i in ids],
                       "prefill_seconds": [r.prefill_seconds for r in results],
                       "peak_mb": peak_memory_mb()}

    return run


def _retrieved(model: Transformer, tokenizer, prompt) -> list[int]:
    head, tail = frame(tokenizer, prompt.asked)
    document = tokenizer.decode(prompt.ids[slice(*prompt.document)])
    return retrieve(model, tokenizer, document, prompt.asked.question,
                    lambda context: head + tokenizer.encode(context) + tail,
                    model.config.context_length - ANSWER_TOKENS, CHUNK_TOKENS, "both").ids


def _share(config: dict, name: str) -> float:
    if len(config["models"]) == 1:
        return config["budget"]
    return config["budget"] * (SMALL_SHARE if name == SMALL else 1 - SMALL_SHARE)


# ---------------------------------------------------------------- what was found


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
        for reading in READINGS:
            out.append(_keeps(results, name, reading, fp32))
        out.append(_linear_memory(results, name))
    return out


def prefill_memory(results: dict, name: str, kv: str = "fp32") -> list[tuple[int, float, float]]:
    """(L, peak MB, median prefill seconds) of `name`'s needle cells read as trained (`none`)
    with `kv`, shortest first; cells without the figures are left out."""
    out = []
    for cell in results.values():
        if (cell.get("model"), cell.get("task"), cell.get("reading"), cell.get("kv")) == \
                (name, "needle", "none", kv) and not cell["skipped"] and cell.get("peak_mb"):
            out.append((cell["length"], cell["peak_mb"], float(np.median(cell["prefill_seconds"]))))
    return sorted(out)


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


def _keeps(results: dict, name: str, reading: str, at_native: float | None) -> dict:
    n = native(name)
    far = {f: _pooled(results, name, reading, "fp32", f * n) for f in FACTORS}
    measured = {f: v for f, v in far.items() if v is not None}
    claim = (f"{name}: {reading} keeps recall past the window (held: at every measured 2×/4×/8×, "
             f"≥ {KEEP:.0%} of the native recall)")
    if at_native is None or at_native < 0.5 or not measured:
        return {"claim": claim, "held": None,
                "evidence": "not measured within the budget" if not measured or at_native is None
                else f"native recall {at_native:.0%} is below 50%: nothing to keep"}
    held = all(v >= KEEP * at_native for v in measured.values())
    return {"claim": claim, "held": held,
            "evidence": ", ".join(f"{v:.0%} at {f}×" for f, v in measured.items())
                        + f" against {at_native:.0%} at the window"}


def summarize(config: dict, results: dict, out: Path) -> Summary:
    rows, figures = [], []
    union = sorted({L for n in config["models"] for L in lengths(n, config["max_length"])})
    for name in config["models"]:
        grid = lengths(name, config["max_length"])
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
                        "caption": "peak resident memory and prefill time against prompt length "
                                   "(needle prompts, read as trained), per KV dtype; the process "
                                   "holds the model too"})
    table = {"title": "Recall (share of depths) against prompt length", "rows": rows,
             "columns": ["model", "task", "reading", *(f"L={L}" for L in union)],
             "note": f"{config['depths']} depths per cell; within the window every reading is "
                     "'none' with that KV dtype; a dash: not run (past the budget, or no such "
                     "length for the model)"}
    return Summary(tables=[table], figures=figures, claims=claims(config, results))


def _readings(config: dict, results: dict, name: str) -> list[tuple[str, str]]:
    """The readings of `name` measured in cells of their own (within the window all are none's)."""
    planned = [(r, "fp32") for r in READINGS] + [("none", kv) for kv in config["kv_dtypes"] if kv != "fp32"]
    return [(r, kv) for r, kv in planned if any(
        c.get("model") == name and c.get("reading") == r and c.get("kv") == kv and not c["skipped"]
        for c in results.values())]


def _draw(fig, config: dict, results: dict, name: str, task: str) -> None:
    grid, rows = lengths(name, config["max_length"]), depths(config)
    readings = _readings(config, results, name) or [("none", "fp32")]
    axes = fig.subplots(1 + (len(readings) > 3), -(-len(readings) // 2) if len(readings) > 3
                        else len(readings), squeeze=False).ravel()
    for ax, (reading, kv) in zip(axes, readings, strict=False):
        image = np.full((len(rows), len(grid)), np.nan)
        for j, L in enumerate(grid):
            cell = results.get(key(name, task, "none" if L <= native(name) else reading, kv, L))
            if cell and not cell["skipped"]:
                image[:, j] = cell["hits"]
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
    for ax, label in ((memory, "peak resident memory (MB)"), (seconds, "prefill (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(label)
        ax.legend(fontsize=6)
