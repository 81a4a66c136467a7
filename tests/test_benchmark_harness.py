"""benchmarks/harness.py and benchmarks/tables.py: the statistic, the alternating rounds, the
record format and the tables made from it (nothing here is timed)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import harness  # noqa: E402
import tables  # noqa: E402


def test_timing_statistics_and_units():
    timing = harness.Timing((0.3, 0.1, 0.2, 0.5))
    assert (timing.median, timing.min, timing.max) == (statistics.median([0.3, 0.1, 0.2, 0.5]), 0.1, 0.5)
    rate = timing.per(10)  # items per second: the slowest round is the lowest rate
    assert rate.min == pytest.approx(10 / 0.5) and rate.max == pytest.approx(10 / 0.1)
    assert timing.scaled(1e3).median == pytest.approx(1e3 * timing.median)


def test_alternating_interleaves_rounds_after_warmup():
    calls = []
    times = harness.alternating({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                repeats=3, warmup=1)
    assert calls == ["a", "b"] * 4
    assert [len(t.samples) for t in times.values()] == [3, 3]
    with pytest.raises(ValueError, match="--repeats"):
        harness.alternating({"a": lambda: None}, repeats=0)


def _args(tmp_path, *argv):
    parser = argparse.ArgumentParser()
    harness.add_arguments(parser, repeats=5)
    return parser.parse_args(["--results", str(tmp_path), *argv])


def test_record_round_trip_into_tables(tmp_path):
    args = _args(tmp_path, "--repeats", "2")
    assert args.repeats == 2
    record = harness.Record("demo", args, "CPU test")
    record.figure("ours", harness.Timing((2.0, 4.0, 3.0)), "ms")
    record.figure("peak memory", 123.0, "MB")
    record.ratio("theirs / ours time", 1.5)
    path = record.write()
    data = json.loads(path.read_text())
    assert data["benchmark"] == "demo" and data["args"]["repeats"] == 2
    assert {"cpu", "threads", "load_average", "commit"} <= data["machine"].keys()
    assert data["figures"][0] == {"name": "ours", "unit": "ms", "median": 3.0, "min": 2.0, "max": 4.0,
                                  "repeats": 3}
    text = tables.records_markdown(tmp_path)
    assert "### `demo`" in text and "| ours | 3 | 2 | 4 | ms | 3 |" in text
    assert "| ratio: theirs / ours time | 1.50 |" in text and "CPU test" in text


def test_no_record_and_bad_records(tmp_path):
    assert harness.Record("demo", _args(tmp_path, "--no-record"), "CPU").write() is None
    assert list(tmp_path.iterdir()) == []
    assert tables.records_markdown(tmp_path).startswith("No records yet")
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a benchmark record"):
        tables.load_records(tmp_path)


def test_readme_headline_is_generated_from_the_records():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert tables.headline_block(readme) == tables.headline_markdown(), \
        "README's headline table differs from the records: python benchmarks/tables.py --headline README.md"


def test_headline_row_takes_the_newest_record_holding_both_figures(tmp_path):
    row = tables.HEADLINE[-1]
    for when, ours, theirs in (("2026-01-01T00:00:00", 30.0, 90.0), ("2026-02-01T00:00:00", 20.0, 100.0)):
        (tmp_path / f"{when[:7]}.json").write_text(json.dumps({
            "benchmark": row.benchmark, "when": when, "ratios": {},
            "machine": {"cpu": "CPU Test CPU: AVX2 yes, AMX no; dispatch AVX2", "threads": 2},
            "figures": [{"name": name, "unit": "s", "median": value, "min": value, "max": value, "repeats": 1}
                        for name, value in ((row.ours, ours), (row.theirs, theirs))]}))
    text = tables.headline_markdown(tmp_path)
    assert f"| {row.what} | 20 s | {row.anchor}: 100 | 0.20× the time | Test CPU, AVX2, no AMX (2) |" in text
    assert "no record yet" in text  # the other rows' benchmarks have no record in this folder
    with pytest.raises(ValueError, match="headline"):
        tables.headline_block("no markers here")
