import re

import pytest

from glassformer.experiments import run_experiment
from glassformer.experiments.decode_cache import LENGTHS
from glassformer.experiments.stats import growth_exponent


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "run"
    return out, run_experiment("cache", out, budget=3, progress=False, models=("tiny",))


def test_report_structure(run):
    out, record = run
    page = (out / "report.html").read_text(encoding="utf-8")
    assert len(re.findall(r"src='data:image/png;base64,", page)) == 1
    assert (out / "cache_decode.png").is_file()
    steps, fits = record["summary"]["tables"]
    assert steps["columns"][:4] == ["model", "context", "no cache (ms)", "KV cache (ms)"]
    assert fits["rows"][0][0] == "tiny"
    assert "tiny: the KV cache turns quadratic decode into linear" in page


def test_numbers_come_from_the_runs(run):
    out, record = run
    cells = record["cells"]
    measured = [cells[f"tiny/{n}"] for n in LENGTHS if not cells[f"tiny/{n}"]["skipped"]]
    assert len(measured) >= 2 and measured[0]["length"] == LENGTHS[0]
    # once a length is skipped for the budget, every longer one is too
    flags = [cells[f"tiny/{n}"]["skipped"] for n in LENGTHS]
    assert flags == sorted(flags)
    steps, fits = record["summary"]["tables"]
    for row, cell in zip(steps["rows"], measured, strict=True):
        assert row[1] == cell["length"]
        assert row[2] == cell["uncached_seconds"] * 1e3 and row[3] == cell["cached_seconds"] * 1e3
        # float32 keys and values: 4 layers x 4 heads x 32 numbers, twice, per token
        assert cell["cache_bytes"] == cell["length"] * 2 * 4 * 4 * 32 * 4
    lengths = [c["length"] for c in measured]
    assert fits["rows"][0][1] == growth_exponent(lengths, [c["uncached_seconds"] for c in measured])
    assert fits["rows"][0][2] == growth_exponent(lengths, [c["cached_seconds"] for c in measured])
