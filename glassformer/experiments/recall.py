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
- retrieve: the best chunks by BM25 and the model's embedding (generation/retrieval.py) in a
  prompt of at most `retrieve_tokens` (default RETRIEVE_TOKENS, or the window if shorter), as a
  retrieval system puts its top chunks, not a whole window, before the question: a small model
  recalls best in a short prompt. The chunks' embeddings are kept by their token ids for the
  whole run, so the depths and lengths that share the haystack read most of it once.
Within the window every reading is the same computation, so only `none` runs there, with
every KV dtype of the pool (KV_DTYPES); past it, every reading with fp32 KV over FAR_DEPTHS
depths (0, 50, 100%: each prompt is a prefill of L tokens, which costs about L^1.5).
`min_length` leaves out the shorter lengths but the window's own `none` fp32 cells, the
figure each reading past the window is judged against.
Cells run shortest first, past the window the retrieve cells (the cheapest) first and the sink
cells (every token past the window attends to a whole window) after every other; once one
cell of a kind (a full prefill, or retrieval) is done, a cell of that kind whose expected time
(the last one's per depth, of the same reading where one ran past the window, grown as L^1.5
for a prefill, as L for retrieval, which embeds the document chunk by chunk, and for sink;
sink's first from a prefill's: the window's, then SINK_PAST times a window token's time per
token past it) would overrun the model's share of the budget is skipped and marked so.
(Prefix caching across the depths is left off: the depth-0 prompt shares nothing, multi-key's
other needles cut the shared part short, and the cells' peak memory would read the cache's.)
Each cell also records what computed it (`--device`: the CPU's name or the GPU's), the prefill
time of each prompt and the peak memory while it ran (reset before it): the process's resident
memory on the CPU (where /proc/self/clear_refs allows the reset), the allocator's on a GPU.
Prompts grow cell by cell, so the peak against L shows how the memory of a long prefill grows
(chunked prefill, the flash kernel: linearly), and with each KV dtype at the window.
The grid is recall_grid.py's; recall_findings.py judges the cells and draws the report.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from ..errors import InputError
from ..formats.files import read_text
from ..generation.config import GenerationConfig, GenerationResult, RequestParams
from ..generation.context_extension import extend_context
from ..generation.generate import generate
from ..generation.retrieval import retrieve
from ..model.sink import SinkPolicy
from ..model.transformer import Transformer
from ..serving.engine import Engine, EngineConfig
from ..serving.kv_pool import KV_DTYPES
from .memory import peak_memory_mb, reset_peak_memory
from .recall_findings import summarize as summarize  # the report run_experiment writes
from .recall_grid import FACTORS, MODELS, READINGS, SMALL, TASKS, depths, key, lengths, native
from .recall_tasks import frame, haystack_prompt, needles, recalled, spells_digits
from .runner import Cell, Context, device_name
from .timed import base_model, train_config, train_timed

NEEDS_DATA = True
TITLE = "Recall: finding a fact in a long context"
SMALL_SHARE = 0.1  # of the budget, its training included
MAX_TRAIN_SECONDS = 600.0
SINK_TOKENS = 4  # sink: the first 4 tokens kept, and the latest (window - 4)
ANSWER_TOKENS = 24  # greedy tokens per answer (a spelled number needs about 20 characters)
CHUNK_TOKENS = 128
RETRIEVE_TOKENS = 1024  # retrieve's prompt at most (SmolLM2 finds a needle at 5 of 5 depths up to 1,024)
SINK_PAST = 2.5  # a sink token past the window costs ~2.5 of a window prefill's tokens
# (SmolLM2 on 2 Xeon cores: the 8,192-token prefill 25 s, 7.6 ms a token past it)


def settings(budget: float, data: Path, models=tuple(MODELS), max_length: int | None = None,
             min_length: int | None = None, retrieve_tokens: int = RETRIEVE_TOKENS) -> dict:
    unknown = sorted(set(models) - set(MODELS))
    if unknown or not models:
        raise InputError("models", f"choose among {', '.join(MODELS)}; got {unknown or 'none'}")
    if max_length is not None and max_length < 256:
        raise InputError("max_length", f"at least 256 tokens, got {max_length}")
    if min_length is not None and not 256 <= min_length <= (max_length or min_length):
        raise InputError("min_length", f"from 256 tokens up to max_length, got {min_length}")
    if retrieve_tokens < 2 * CHUNK_TOKENS:
        raise InputError("retrieve_tokens",
                         f"at least {2 * CHUNK_TOKENS} (two chunks), got {retrieve_tokens}")
    return {"budget": budget, "data": str(data), "models": list(models), "max_length": max_length,
            "min_length": min_length, "retrieve_tokens": retrieve_tokens,
            "depths": 11 if budget >= 3600 else 5 if budget >= 60 else 3, "kv_dtypes": list(KV_DTYPES),
            "train_seconds": round(min(max(SMALL_SHARE * budget / 2, 1.0), MAX_TRAIN_SECONDS), 2)}


def cells(config: dict, device: str = "cpu") -> list[Cell]:
    """The plan's cells; the model and the engine run on `device` (the cells of one run folder
    may come from several devices: each records its own)."""
    loaded: dict[str, tuple] = {}  # each model, its haystack and its chunks' embeddings, once per process
    out = [Cell(f"train/{SMALL}", _train_cell, f"train {SMALL}")] if SMALL in config["models"] else []
    for name in config["models"]:
        planned = []  # (length, task, reading, kv)
        for length in lengths(name, config["max_length"], config["min_length"]):
            if length > native(name):
                readings = [(r, "fp32") for r in READINGS]
            elif config["min_length"] and length < config["min_length"]:
                readings = [("none", "fp32")]  # the figure the readings past the window are judged against
            else:
                readings = [("none", kv) for kv in config["kv_dtypes"]]
            planned += [(length, task, r, kv) for task in TASKS for r, kv in readings]
        # past the window retrieval first, then by length, sink (the dearest) after all others
        planned.sort(key=lambda c: (c[0] > native(name), c[2] != "retrieve", c[2] == "sink", c[0]))
        out += [Cell(key(name, task, r, kv, length), _recall_cell(name, task, r, kv, length, loaded, device),
                     f"{name} {task} {r} {kv} at {length}") for length, task, r, kv in planned]
    return out


def _train_cell(ctx: Context) -> dict:
    folder = ctx.folder(f"train/{SMALL}")
    config = base_model().replace(position="rope", context_length=native(SMALL))
    summary = train_timed(ctx.settings["data"], folder, config,
                          train_config(ctx.settings["train_seconds"], seed=0))
    for state in folder.glob("step-*/training_state.safetensors"):
        state.unlink()
    return {"model": SMALL, "iters": summary["iters"], "val_loss": summary["val_loss"]}


def _model(ctx: Context, name: str, loaded: dict, device: str) -> tuple:
    """(model, tokenizer, haystack ids, chunk embeddings by token ids) of `name`, loaded once."""
    if name not in loaded:
        if name == SMALL:
            from ..formats.checkpoint import load_model

            model, tokenizer, _ = load_model(ctx.kept(f"train/{SMALL}"))
        else:
            from ..language_model import load

            language_model = load(name, progress=False)
            model, tokenizer = language_model.model, language_model.tokenizer
        longest = native(name) * FACTORS[-1]
        text = read_text(ctx.settings["data"])[: 6 * longest]
        loaded[name] = (model.to(device).eval(), tokenizer, tokenizer.encode(text), {})
    return loaded[name]


def reader(model: Transformer, reading: str, length: int) -> Transformer:
    """The model that reads `length` tokens the way `reading` does (retrieve and sink: the
    model itself; sink is a cache policy)."""
    n = model.config.context_length
    if length <= n or reading in ("retrieve", "sink"):
        return model
    if reading == "window":
        with torch.device(model.embed.tokens.weight.device):
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
    """Greedy answers, one request at a time through the engine with `kv_dtype` pool; under
    the attention-sink policy `sink` (float32 keys) through `generate`'s dense sink cache,
    which reads a prompt past the window in chunks (model/sink_chunk.py) as the pool does."""
    if sink is not None:
        config = GenerationConfig(max_new_tokens=ANSWER_TOKENS, stop=("\n",), sink=sink)
        return [generate(model, p, config, tokenizer) for p in prompt_ids]
    longest = max(len(p) for p in prompt_ids) + ANSWER_TOKENS
    engine = Engine(model, tokenizer, EngineConfig(
        kv_dtype=kv_dtype, n_blocks=-(-longest // 16) + 1, block_size=16, max_batch=1,
        token_budget=512, prefix_caching=False, batch_invariant=False, sink=sink))
    params = RequestParams(max_new_tokens=ANSWER_TOKENS, stop=("\n",))  # the answer's first line
    out = []
    for p in prompt_ids:  # each submitted alone, so its prefill time holds no queueing
        handle = engine.submit(p, params)
        engine.run_until_done()
        out.append(handle.wait(0))
    return out


def _retrieves(cell: dict) -> bool:
    return cell["reading"] == "retrieve" and cell["length"] > native(cell["model"])


def _expected(results: dict, planned: dict) -> float | None:
    """Seconds the `planned` cell should take, from the last finished cell of its model with its
    reading past the window, else of its kind: retrieval (grown as L per depth), or a full
    prefill other than sink's (as L^1.5; sink as L; sink's first: a prefill of the window, then
    SINK_PAST window tokens' time per token past it). None: no such cell yet."""
    done = [r for r in results.values() if r.get("model") == planned["model"] and "reading" in r
            and not r["skipped"]]
    alike = [r for r in done if r["reading"] == planned["reading"] and r["length"] > native(r["model"])]
    kind = [r for r in done if _retrieves(r) == _retrieves(planned) and r["reading"] != "sink"]
    if not alike and not kind:
        return None
    last = (alike or kind)[-1]
    power = 1.0 if _retrieves(planned) or planned["reading"] == "sink" else 1.5
    per_depth = last["cell_seconds"] / len(last["depths"])
    length, n = planned["length"], native(planned["model"])
    if planned["reading"] == "sink" and not alike and length > n:
        window = per_depth * (n / last["length"]) ** power  # a prefill of the window
        return len(planned["depths"]) * window * (1 + SINK_PAST * (length - n) / n)
    return per_depth * len(planned["depths"]) * max(length / last["length"], 1.0) ** power


def _recall_cell(name: str, task: str, reading: str, kv: str, length: int, loaded: dict, device: str):
    def run(ctx: Context) -> dict:
        spent = sum(r["cell_seconds"] for k, r in ctx.results.items() if k.startswith(f"{name}/"))
        base = {"model": name, "task": task, "reading": reading, "kv": kv, "length": length}
        n = native(name)
        grid = depths(ctx.settings, past_window=length > n)
        expected = _expected(ctx.results, base | {"depths": grid})
        if expected is not None and spent + expected > _share(ctx.settings, name):
            return base | {"skipped": True}
        model, tokenizer, hay, embedded = _model(ctx, name, loaded, device)
        asked = prompts(tokenizer, hay, task, length, grid)
        ids = [p.ids for p in asked]
        found = {}
        if reading == "retrieve" and length > n:
            limit = min(ctx.settings["retrieve_tokens"], n) - ANSWER_TOKENS
            ids = [_retrieved(model, tokenizer, p, limit, embedded) for p in asked]
            found = {"in_prompt": [p.asked.sentence in tokenizer.decode(i) for p, i in
                                   zip(asked, ids, strict=True)]}  # did retrieval keep the needle?
        sink = SinkPolicy(SINK_TOKENS, n - SINK_TOKENS) if reading == "sink" and length > n else None
        reset_peak_memory(device)
        with torch.no_grad():
            results = answers(reader(model, reading, length), tokenizer, ids, kv, sink)
        texts = [r.text for r in results]
        return base | {"skipped": False, "device": device_name(device), "depths": grid, "answers": texts,
                       "expected": [p.asked.value for p in asked],
                       "hits": [recalled(t, p.asked) for t, p in zip(texts, asked, strict=True)],
                       "prompt_tokens": [len(i) for i in ids],
                       "prefill_seconds": [r.prefill_seconds for r in results],
                       "peak_mb": peak_memory_mb(device)} | found

    return run


def _retrieved(model: Transformer, tokenizer, prompt, limit: int, embedded: dict) -> list[int]:
    head, tail = frame(tokenizer, prompt.asked)
    document = tokenizer.decode(prompt.ids[slice(*prompt.document)])
    return retrieve(model, tokenizer, document, prompt.asked.question,
                    lambda context: head + tokenizer.encode(context) + tail,
                    limit, CHUNK_TOKENS, "both", embedded).ids


def _share(config: dict, name: str) -> float:
    if len(config["models"]) == 1:
        return config["budget"]
    return config["budget"] * (SMALL_SHARE if name == SMALL else 1 - SMALL_SHARE)
