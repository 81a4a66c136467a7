"""The documentation's performance tables, made from the records in `benchmarks/results/`.

One section per benchmark, one table per record (newest first, at most `--latest` per
benchmark): each figure as median with min and max and the rounds they came from, the ratios,
and the machine the record names (CPU, threads, load average, commit). The documentation
build calls `records_markdown` (docs/hooks.py); run alone it prints the same Markdown:

    python benchmarks/tables.py [--results benchmarks/results] [--latest 3]

The README's headline table (speed against the anchors) is made here too, from the newest
record that holds both figures of each row; `--headline README.md` rewrites the block between
the README's headline markers, and the test suite checks that the README matches the records.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import NamedTuple

RESULTS = Path(__file__).resolve().parent / "results"
HEADLINE_START, HEADLINE_END = "<!-- --8<-- [start:headline] -->", "<!-- --8<-- [end:headline] -->"


class Headline(NamedTuple):
    """One row of the headline table: our figure against an anchor's, from one record."""

    what: str
    benchmark: str
    ours: str  # figure names in that benchmark's records
    theirs: str
    anchor: str


HEADLINE = (
    Headline("decode, one stream, greedy 128 tokens of SmolLM2's Q4_1 GGUF", "pretrained_speed",
             "glassformer gguf, decode (greedy 128)", "llama.cpp, decode (greedy 128)", "llama.cpp"),
    Headline("decode, the same file, int4 weights", "pretrained_speed",
             "glassformer int4, decode (greedy 128)", "transformers, decode (greedy 128)",
             "transformers fp32"),
    Headline("decode, the same file, float32 weights", "pretrained_speed",
             "glassformer none, decode (greedy 128)", "transformers, decode (greedy 128)",
             "transformers fp32"),
    Headline("prefill of 512 tokens, float32 weights", "pretrained_speed",
             "glassformer none, prefill (512)", "transformers, prefill (512)", "transformers fp32"),
    Headline("prefill of 512 tokens, int4 weights", "pretrained_speed",
             "glassformer int4, prefill (512)", "transformers, prefill (512)", "transformers fp32"),
    Headline("engine, 8 prompts × 64 tokens, int4", "engine_throughput",
             "a engine int4 x8, tokens_per_s", "a transformers fp32, tokens_per_s", "transformers fp32"),
    Headline("training to validation loss 1.886 (`shakespeare-char-fast`)", "time_to_loss",
             "shakespeare-char-fast, whole process", "nanoGPT recipe, whole process", "nanoGPT recipe"),
)


def load_records(folder: Path) -> list[dict]:
    """Every record in `folder`, newest first; a file that is not a record is an error."""
    records = []
    for path in sorted(Path(folder).glob("*.json")):
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not {"benchmark", "when", "machine", "figures"} <= record.keys():
            raise ValueError(f"{path}: not a benchmark record (benchmark, when, machine, figures)")
        records.append(record)
    return sorted(records, key=lambda r: r["when"], reverse=True)


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def record_table(record: dict) -> str:
    m = record["machine"]
    commit = (m.get("commit") or "unknown")[:10] + (" (modified)" if m.get("dirty") else "")
    load = ", ".join(str(x) for x in m.get("load_average", []))
    lines = [
        f"**{record['when']}**, `{' '.join(record.get('argv', [])) or '(defaults)'}`: {m['cpu']}; "
        f"{m['threads']} threads; load average {load}; commit `{commit}`.",
        "",
        "| figure | median | min | max | unit | rounds |",
        "|---|---|---|---|---|---|",
    ]
    for f in record["figures"]:
        lines.append(f"| {f['name']} | {_number(f['median'])} | {_number(f['min'])} | {_number(f['max'])} "
                     f"| {f['unit']} | {f['repeats']} |")
    for name, value in record.get("ratios", {}).items():
        lines.append(f"| ratio: {name} | {value:.2f} | | | × | |")
    return "\n".join(lines) + "\n"


def records_markdown(folder: Path = RESULTS, latest: int = 3) -> str:
    records = load_records(folder) if Path(folder).is_dir() else []
    if not records:
        return ("No records yet: run a benchmark (each writes one to `benchmarks/results/`) "
                "and build the site again.\n")
    by_benchmark: dict[str, list[dict]] = {}
    for record in records:
        by_benchmark.setdefault(record["benchmark"], []).append(record)
    parts = []
    for name in sorted(by_benchmark):
        parts.append(f"### `{name}`\n")
        parts += [record_table(r) for r in by_benchmark[name][:latest]]
    return "\n".join(parts)


def cpu_name(machine: dict) -> str:
    """The record's CPU line cut to the processor and the features it has."""
    line = machine["cpu"].removeprefix("CPU ").split(";")[0].replace("(R)", "")
    name, _, features = line.partition(": ")
    have = [f.removesuffix(" yes") for f in features.split(", ") if f.endswith(" yes")]
    lacks = [f"no {f.removesuffix(' no')}" for f in features.split(", ") if f.endswith(" no")]
    return ", ".join([name, *have, *lacks])


def headline_markdown(folder: Path = RESULTS) -> str:
    """The README's headline table; a row no record holds yet says so."""
    records = load_records(folder) if Path(folder).is_dir() else []
    lines = ["| what | Glassformer | anchor | ratio | CPU (threads) | record |", "|---|---|---|---|---|---|"]
    for row in HEADLINE:
        found = next(((r, {f["name"]: f for f in r["figures"]}) for r in records
                      if r["benchmark"] == row.benchmark
                      and {row.ours, row.theirs} <= {f["name"] for f in r["figures"]}), None)
        if found is None:
            lines.append(f"| {row.what} | no record yet | {row.anchor} | | | `{row.benchmark}.py` |")
            continue
        record, figures = found
        ours, theirs = figures[row.ours], figures[row.theirs]
        unit = ours["unit"]
        ratio = ours["median"] / theirs["median"]
        ratio_text = f"{ratio:.2f}× the time" if unit == "s" else f"{ratio:.1f}×"
        lines.append(f"| {row.what} | {_number(ours['median'])} {unit} | {row.anchor}: "
                     f"{_number(theirs['median'])} | {ratio_text} | {cpu_name(record['machine'])} "
                     f"({record['machine']['threads']}) | `{row.benchmark}.py`, {record['when'][:10]} |")
    return "\n".join(lines) + "\n"


def headline_block(text: str) -> str:
    """What stands between the headline markers of `text` (the README)."""
    match = re.search(re.escape(HEADLINE_START) + r"\n(.*?)" + re.escape(HEADLINE_END), text, re.S)
    if match is None:
        raise ValueError(f"no headline block ({HEADLINE_START} ... {HEADLINE_END})")
    return match.group(1)


def write_headline(readme: Path, folder: Path = RESULTS) -> None:
    text = readme.read_text()
    old = headline_block(text)
    new = headline_markdown(folder)
    readme.write_text(text.replace(HEADLINE_START + "\n" + old, HEADLINE_START + "\n" + new))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--latest", type=int, default=3, help="records shown per benchmark")
    parser.add_argument("--headline", type=Path, metavar="README",
                        help="rewrite the headline table in this README from the records")
    args = parser.parse_args()
    if args.headline:
        write_headline(args.headline, args.results)
        return
    print(records_markdown(args.results, args.latest), end="")


if __name__ == "__main__":
    main()
