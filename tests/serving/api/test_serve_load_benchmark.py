"""benchmarks/serve_load.py end to end on a tiny checkpoint, two new tokens a request, two
rounds: every run sends its workload's requests and gets their tokens back, every other request
of the inspect and adapter comparisons inspects or names the adapter, and each ratio is the
median of its rounds' ratios (nothing here is timed)."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from glassformer import Transformer, get_preset
from glassformer.formats.checkpoint import write_checkpoint

ROOT = Path(__file__).resolve().parents[3]


def test_serve_load_runs_every_configuration_in_rounds(tmp_path, language_model):
    torch.manual_seed(0)
    tokenizer = language_model.tokenizer
    config = get_preset("tiny-llama").replace(context_length=1024, vocab_size=tokenizer.vocab_size)
    folder = write_checkpoint(tmp_path / "model", Transformer(config).eval(), tokenizer, {})
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog, 12 times.\n" * 60)
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--model", str(folder),
         "--modes", "none", "--clients", "1", "8", "--compare-clients", "2", "--new-tokens", "2",
         "--repeats", "2", "--threads", "1", "--corpus", str(corpus), "--results", str(tmp_path / "records"),
         "--json"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "LLAMA_CPP_DIR": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    rows = {row["label"]: row for row in out["runs"]}
    load = [f"none {w} x{c}" for w in ("anchor", "mixed", "shared") for c in (1, 8)]
    compared = [f"none anchor x2 inspect {v}" for v in ("off", "none", "half", "layers")] + \
               [f"none anchor x2 adapter {v}" for v in ("base", "half")]
    assert list(rows) == load + compared
    requests = {"anchor": 8, "mixed": 16, "shared": 16}  # anchor: max(8, clients)
    for label, row in rows.items():
        assert row["requests"] == requests[row["workload"]] and row["tokens"] == 2 * row["requests"], label
        assert len(row["rounds_tokens_per_second"]) == 2 and row["peak_rss_mb"] >= row["rss_mb"] > 0
        assert row["inspected"] == (4 if label.endswith(("inspect half", "inspect layers")) else 0)
        assert row["adapted"] == (4 if label.endswith("adapter half") else 0)
        assert 0 < row["client_cpu_s_per_token"] < row["wall_s"], label  # the client's own CPU
    assert {rows[label]["server"] for label in compared} == {"off", "base", "lora"}

    def ratio(top, bottom):
        return statistics.median(a / b for a, b in zip(rows[top]["rounds_tokens_per_second"],
                                                       rows[bottom]["rounds_tokens_per_second"], strict=True))

    expected = {f"none {w} x8 / x1 tokens/s": (f"none {w} x8", f"none {w} x1") for w in requests}
    for v in ("none", "half", "layers"):
        expected[f"none anchor x2 inspect {v} / off tokens/s"] = (f"none anchor x2 inspect {v}",
                                                                  "none anchor x2 inspect off")
    expected["none anchor x2 adapter half / base tokens/s"] = ("none anchor x2 adapter half",
                                                               "none anchor x2 adapter base")
    ratios = out["ratios"]
    alone = {f"none anchor x{c}: server / engine alone tokens/s" for c in (1, 8)}
    assert set(ratios) == set(expected) | alone  # no llama.cpp binaries given: no llama-server rows
    assert "llama.cpp: no --llama-cpp folder" in run.stderr
    for name, (top, bottom) in expected.items():
        assert ratios[name] == ratio(top, bottom), name
    record = json.loads(next((tmp_path / "records").glob("serve_load-*.json")).read_text())
    assert record["ratios"] == ratios and record["machine"]["cpu"].startswith("CPU ")
    assert {f["name"] for f in record["figures"]} >= {f"{label}, tokens/s" for label in rows} | {
        f"none anchor x{c}, engine alone, tokens/s" for c in (1, 8)}
