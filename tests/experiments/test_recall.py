import json
import re

import pytest
import torch

from glassformer.cli import main
from glassformer.experiments import recall, recall_findings, run_experiment
from glassformer.experiments.recall import ANSWER_TOKENS, SMALL, key, native
from glassformer.experiments.recall_findings import claims
from glassformer.experiments.recall_tasks import recalled
from glassformer.experiments.runner import Context
from glassformer.generation.generate import GenerationConfig, generate

SMOL = "smollm2-135m-instruct"


def _config(depths=11, kv=("fp32", "bf16", "int8")):
    return {"models": [SMOL], "depths": depths, "kv_dtypes": list(kv)}


def _cell(hits: int, depths: int = 11) -> dict:
    return {"skipped": False, "depths": [i / (depths - 1) for i in range(depths)],
            "hits": [i < hits for i in range(depths)]}


def _judged(results: dict, config=None) -> dict[str, bool | None]:
    return {c["claim"].split(" (held")[0]: c["held"] for c in claims(config or _config(), results)}


N = native(SMOL)
NATIVE = f"{SMOL}: the needle is found at the native window ({N} tokens), no scaling, fp32 KV"


@pytest.mark.parametrize("hits, held", [(11, True), (10, True), (9, False), (None, None)])
def test_native_claim_is_held_at_90_percent_of_the_depths(hits, held):
    results = {} if hits is None else {key(SMOL, "needle", "none", "fp32", N): _cell(hits)}
    assert _judged(results)[NATIVE] is held


@pytest.mark.parametrize("fp32, int8, held", [((11, 11), (11, 10), True), ((11, 11), (10, 10), False),
                                              ((11, 10), (10, 10), True), ((3, 3), (0, 0), None)])
def test_quantized_kv_is_held_within_5_points_of_fp32_pooled_over_both_tasks(fp32, int8, held):
    results = {}
    for kv, hits in (("fp32", fp32), ("int8", int8)):
        for task, n in zip(("needle", "multikey"), hits, strict=True):
            results[key(SMOL, task, "none", kv, N)] = _cell(n)
    judged, claim = _judged(results), f"{SMOL}: the {{}} KV cache keeps recall within 5 points of fp32"
    assert judged[claim.format("int8") + " at the native window"] is held
    assert judged[claim.format("bf16") + " at the native window"] is None


def test_a_reading_keeps_recall_when_every_measured_factor_reaches_90_percent_of_native():
    results = {key(SMOL, t, "none", "fp32", N): _cell(10) for t in ("needle", "multikey")}
    results |= {key(SMOL, t, "yarn", "fp32", 2 * N): _cell(9) for t in ("needle", "multikey")}
    results |= {key(SMOL, t, "linear", "fp32", 2 * N): _cell(11) for t in ("needle", "multikey")}
    results |= {key(SMOL, t, "linear", "fp32", 4 * N): _cell(8) for t in ("needle", "multikey")}
    results[key(SMOL, "needle", "window", "fp32", 2 * N)] = {"skipped": True}
    judged = _judged(results)
    keeps = f"{SMOL}: {{}} keeps recall past the window"
    assert judged[keeps.format("yarn")] is True  # 9/11 ≥ 0.9 · 10/11
    assert judged[keeps.format("linear")] is False  # 8/11 at 4× falls short
    assert judged[keeps.format("window")] is None and judged[keeps.format("retrieve")] is None


def _memory_cells(peaks: dict[int, float]) -> dict:
    return {key(SMOL, "needle", "none", "fp32", n): {
        "model": SMOL, "task": "needle", "reading": "none", "kv": "fp32", "length": n,
        "skipped": False, "peak_mb": mb, "prefill_seconds": [0.1], "hits": [True], "depths": [0.0]}
        for n, mb in peaks.items()}


@pytest.mark.parametrize("per_token, held", [(lambda n: 0.05 * n, True),  # linear: held
                                             (lambda n: 1e-5 * n * n, False),  # quadratic
                                             (None, None)])  # not measured
def test_prefill_memory_is_judged_linear_from_the_growth_per_token(per_token, held):
    peaks = {} if per_token is None else {n: 500 + per_token(n) for n in (1024, 2048, 4096, 8192)}
    claim = f"{SMOL}: a long prefill's peak memory grows linearly with the prompt"
    assert _judged(_memory_cells(peaks))[claim] is held


def test_prefill_memory_reads_one_device_the_one_of_the_longest_prompt():
    """A CPU's resident memory and a GPU's allocations are two curves: the longest prompt's
    device gives the points."""
    cells = _memory_cells({n: 500 + 0.05 * n for n in (1024, 2048, 4096)})
    for cell in cells.values():
        cell["device"] = "a CPU"
    gpu = _memory_cells({n: 10 + 1e-3 * n for n in (4096, 8192)})
    for cell in gpu.values():
        cell["device"] = "a GPU"
    results = {**cells, **{k + "/gpu": c for k, c in gpu.items()}}
    assert [n for n, _, _ in recall_findings.prefill_memory(results, SMOL)] == [4096, 8192]
    assert [mb for _, mb, _ in recall_findings.prefill_memory(results, SMOL)] == [10 + 4.096, 10 + 8.192]


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("recall") / "run"
    record = run_experiment("recall", out, budget=50, data=corpus, progress=False, models=(SMALL,),
                            max_length=1024)
    return out, record


def test_cells_score_their_answers_and_the_report_holds_a_heat_map_per_task(run):
    out, record = run
    cells = {k: c for k, c in record["cells"].items() if not k.startswith("train/")}
    assert next(iter(cells)) == key(SMALL, "needle", "none", "fp32", 512)  # shortest first
    measured = [c for c in cells.values() if not c["skipped"]]
    assert measured and all(c["depths"] == recall.depths(record["settings"], c["length"] > native(SMALL))
                            and len(c["hits"]) == len(c["depths"]) for c in measured)
    for c in measured:
        assert c["hits"] == [e in a for a, e in zip(c["answers"], c["expected"], strict=True)]
        window = native(SMALL) - ANSWER_TOKENS if c["reading"] == "retrieve" else c["length"] - ANSWER_TOKENS
        assert all(n <= window for n in c["prompt_tokens"])
        assert len(c["prefill_seconds"]) == len(c["hits"]) and all(t > 0 for t in c["prefill_seconds"])
        assert c["peak_mb"] > 0
    page = (out / "report.html").read_text(encoding="utf-8")
    assert len(re.findall(r"src='data:image/png;base64,", page)) == 3  # two heat maps, the memory
    assert "Past the window: recall kept" in page
    assert {c["claim"].split(":")[0] for c in record["summary"]["claims"]} == {SMALL}


def test_engine_answers_match_greedy_generate_with_the_dense_cache(run):
    """The first cell again, through generate (the dense fp32 cache) instead of the engine."""
    out, record = run
    from glassformer.formats.checkpoint import load_model

    model, tokenizer, _ = load_model(out / "cells" / f"train_{SMALL}")
    with open(record["settings"]["data"], encoding="utf-8") as text:
        hay = tokenizer.encode(text.read())
    grid = recall.depths(record["settings"])
    asked = recall.prompts(tokenizer, hay, "needle", 512, grid)
    config = GenerationConfig(max_new_tokens=ANSWER_TOKENS, stop=("\n",))
    answers = [generate(model.eval(), p.ids, config, tokenizer).text for p in asked[:2]]
    cell = record["cells"][key(SMALL, "needle", "none", "fp32", 512)]
    assert answers == cell["answers"][:2]
    assert cell["expected"] == [p.asked.value for p in asked]
    assert cell["hits"][:2] == [recalled(a, p.asked) for a, p in zip(answers, asked[:2], strict=True)]


def test_resume_skips_finished_cells(run, corpus, monkeypatch):
    out, record = run
    first = key(SMALL, "needle", "none", "fp32", 512)
    saved = json.loads((out / "results.json").read_text())
    del saved["cells"][first]
    (out / "results.json").write_text(json.dumps(saved))
    ran = []
    real = recall.answers
    monkeypatch.setattr(recall, "answers", lambda *a: ran.append(a[3]) or real(*a))
    again = run_experiment("recall", out, budget=50, data=corpus, progress=False, models=(SMALL,),
                           max_length=1024)
    assert ran == ["fp32"]  # only the removed cell ran again
    assert again["cells"][first]["answers"] == record["cells"][first]["answers"]
    assert set(again["cells"]) == set(record["cells"])


def test_every_reading_runs_past_the_window(corpus, tmp_path):
    """Each reading's cell at twice the window, on a random two-layer model of the small shape."""
    from glassformer.experiments.runner import Context, cpu_name
    from glassformer.experiments.timed import base_model
    from glassformer.formats.tokenizers import CharTokenizer
    from glassformer.model.transformer import Transformer

    text = corpus.read_text(encoding="utf-8")
    tokenizer = CharTokenizer.train([text])
    torch.manual_seed(0)
    model = Transformer(base_model().replace(position="rope", context_length=native(SMALL), n_layers=2,
                                             d_model=64, n_heads=4, vocab_size=tokenizer.vocab_size))
    embedded = {}
    loaded = {SMALL: (model.eval(), tokenizer, tokenizer.encode(text), embedded)}
    ctx = Context(tmp_path, {"depths": 5, "budget": 1e9, "models": [SMALL], "retrieve_tokens": 384}, {})
    length = 2 * native(SMALL)
    for reading in recall.READINGS:
        cell = recall._recall_cell(SMALL, "multikey", reading, "fp32", length, loaded, "cpu")(ctx)
        assert not cell["skipped"] and cell["depths"] == [0.0, 0.5, 1.0] and len(cell["hits"]) == 3
        assert cell["device"] == cpu_name()  # each cell names what computed it
        if reading == "retrieve":  # whole chunks, as many as fit retrieve's budget
            room = 384 - ANSWER_TOKENS
            assert all(room - recall.CHUNK_TOKENS < n <= room for n in cell["prompt_tokens"])
            assert len(cell["in_prompt"]) == 3 and embedded  # the chunks' embeddings kept for the run
        else:
            assert cell["prompt_tokens"] == [length - ANSWER_TOKENS] * 3
    wide = recall.reader(model, "window", length)
    assert wide.config.sliding_window == native(SMALL) and wide.config.context_length == length
    assert recall.reader(model, "yarn", length).config.rope_factor == 2
    assert recall.reader(model, "retrieve", length) is model


@pytest.mark.parametrize("extra, message", [
    (["cache", "--models", "tiny"], "--models: applies to the recall experiment only"),
    (["recall", "--models", "gpt-9"], "models: choose among"),
    (["recall", "--max-length", "100"], "--max-length: at least 256 tokens"),
    (["recall", "--min-length", "4096", "--max-length", "1024"], "--min-length: from 256 tokens up to"),
    (["recall", "--retrieve-tokens", "200"], "--retrieve-tokens: at least 256 (two chunks)"),
    (["cache", "--retrieve-tokens", "512"], "--retrieve-tokens: applies to the recall experiment only"),
    (["length", "--device", "cpu"], "device: the length experiment runs on the CPU"),
])
def test_user_mistakes_are_one_line(tmp_path, capsys, extra, message):
    assert main(["experiment", *extra, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_past_the_window_three_depths_and_retrieval_first_from_min_length(tmp_path):
    config = recall.settings(7200, tmp_path, models=(SMOL,), min_length=2 * N)
    assert recall.depths(config) == [i / 10 for i in range(11)]
    assert recall.depths(config, past_window=True) == [0.0, 0.5, 1.0]
    planned = [c.key for c in recall.cells(config)]
    within = [key(SMOL, t, "none", "fp32", N) for t in recall.TASKS]  # the reference, no other dtype
    assert planned[:2] == within
    assert planned[2:8] == [key(SMOL, t, "retrieve", "fp32", f * N) for f in (2, 4, 8) for t in recall.TASKS]
    rest = planned[8:]
    assert len(rest) == 3 * 2 * (len(recall.READINGS) - 1) and "/retrieve/" not in "".join(rest)
    sinks, others = rest[-6:], rest[:-6]  # sink, the dearest, after every other reading
    assert all("/sink/" in k for k in sinks) and not any("/sink/" in k for k in others)
    for part in (sinks, others):  # each shortest first
        assert [int(k.rsplit("/", 1)[1]) for k in part] == sorted(int(k.rsplit("/", 1)[1]) for k in part)


def _done(reading: str, length: int, seconds: float, depths: int = 3) -> dict:
    return {"model": SMOL, "task": "needle", "reading": reading, "kv": "fp32", "length": length,
            "skipped": False, "depths": [0.0] * depths, "cell_seconds": seconds}


def test_expected_time_grows_from_the_last_cell_of_its_kind():
    results = {"a": _done("none", N, 500.0, depths=5), "b": _done("retrieve", 2 * N, 60.0)}
    planned = {"model": SMOL, "length": 4 * N, "depths": [0.0, 0.5, 1.0]}
    # a prefill: 100 s per depth at N, grown as 4^1.5; retrieval: 20 s per depth at 2N, grown as 2
    assert recall._expected(results, planned | {"reading": "linear"}) == pytest.approx(300 * 8)
    assert recall._expected(results, planned | {"reading": "retrieve"}) == pytest.approx(120)
    assert recall._expected({"a": results["a"]}, planned | {"reading": "retrieve"}) is None
    # sink's first cell: a prefill of the window (100 s), then 3N tokens at SINK_PAST tokens' time each
    assert recall._expected(results, planned | {"reading": "sink"}) == pytest.approx(
        3 * 100 * (1 + recall.SINK_PAST * 3))
    results["c"] = _done("sink", 2 * N, 3000.0)  # a reading of its own past the window: its own
    assert recall._expected(results, planned | {"reading": "sink"}) == pytest.approx(3000 * 2)  # as L
    assert recall._expected(results, planned | {"reading": "none"}) == pytest.approx(300 * 8)


def test_a_cheap_retrieve_cell_runs_where_a_prefill_would_overrun_the_budget(tmp_path, monkeypatch):
    results = {key(SMOL, "needle", "none", "fp32", N): _done("none", N, 500.0),
               key(SMOL, "needle", "retrieve", "fp32", 2 * N): _done("retrieve", 2 * N, 10.0)}
    ctx = Context(tmp_path, {"depths": 5, "budget": 1000.0, "models": [SMOL], "retrieve_tokens": 1024},
                  results)
    loads = []

    def load(ctx, name, loaded, device):  # the point where a cell that runs starts its work
        loads.append(name)
        raise LookupError(name)

    monkeypatch.setattr(recall, "_model", load)
    cell = recall._recall_cell(SMOL, "needle", "yarn", "fp32", 2 * N, {}, "cpu")(ctx)
    assert cell["skipped"] and not loads  # 500 s · 2^1.5 ≫ the 490 s left
    with pytest.raises(LookupError):  # 10 s · 2 fits: it runs
        recall._recall_cell(SMOL, "needle", "retrieve", "fp32", 4 * N, {}, "cpu")(ctx)
    assert loads == [SMOL]


def test_each_factor_says_which_readings_keep_recall():
    results = {key(SMOL, t, "none", "fp32", N): _cell(10) for t in ("needle", "multikey")}
    results |= {key(SMOL, t, "retrieve", "fp32", 2 * N): _cell(10) for t in ("needle", "multikey")}
    results |= {key(SMOL, t, "yarn", "fp32", 2 * N): _cell(4) for t in ("needle", "multikey")}
    results[key(SMOL, "needle", "none", "fp32", 4 * N)] = _cell(2)
    claims_ = {c["claim"].split(" (held")[0]: c for c in claims(_config(), results)}
    at = f"{SMOL}: at {{}}× the window ({{}} tokens) a reading keeps recall"
    two, four, eight = (claims_[at.format(f, f * N)] for f in (2, 4, 8))
    assert two["held"] is True
    assert two["evidence"].startswith("kept: retrieve; lost: yarn; not measured: none")
    assert four["held"] is False and four["evidence"].startswith("lost: none; not measured")
    assert eight["held"] is None and eight["evidence"] == f"not measured: {', '.join(recall.READINGS)}"
    assert recall_findings.verdict(results, SMOL, "none", 4) == "lost"  # needle alone: 2/11 against 10/11
