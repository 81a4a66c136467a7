"""The documentation's performance tables, made from the records in `benchmarks/results/`.

One section per benchmark, one table per record (newest first, at most `--latest` per
benchmark): each figure as median with min and max and the rounds they came from, the ratios,
and the machine the record names (CPU, threads, load average, commit). The documentation
build calls `records_markdown` (docs/hooks.py); run alone it prints the same Markdown:

    python benchmarks/tables.py [--results benchmarks/results] [--latest 3]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--latest", type=int, default=3, help="records shown per benchmark")
    args = parser.parse_args()
    print(records_markdown(args.results, args.latest), end="")


if __name__ == "__main__":
    main()
