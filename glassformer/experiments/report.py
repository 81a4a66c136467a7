"""The report: figures as PNG files, and one self-contained HTML page (plots inline)."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Callable
from pathlib import Path

from ..formats.files import write_atomic


def save_figure(out: Path, name: str, draw: Callable, size=(7.0, 4.2)) -> str:
    """Draw onto a bare matplotlib Figure (no pyplot) with `draw(fig)`; write `out/name`."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=100)
    draw(fig)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    write_atomic(out / name, buffer.getvalue())
    return name


def fmt(value, digits: int = 3) -> str:
    """A number for a table: None as a dash, large values with thousands separators."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}g}"
    return str(value)


def text_table(table: dict) -> str:
    """A table as aligned plain text, for the terminal."""
    rows = [table["columns"]] + [[fmt(v) for v in row] for row in table["rows"]]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([table["title"], *lines])


def text_summary(summary: dict) -> str:
    parts = [text_table(t) for t in summary["tables"]]
    parts += [f"[{_verdict(c['held'])}] {c['claim']}: {c['evidence']}" for c in summary["claims"]]
    return "\n\n".join(parts)


def _verdict(held) -> str:
    return {True: "held", False: "did not hold", None: "inconclusive"}[held]


def write_html(out: Path, title: str, record: dict) -> Path:
    """report.html: the claims and what was found, the tables, the plots (base64 PNG) and
    the machine the numbers came from."""
    summary, e = record["summary"], html.escape
    body = [f"<h1>{e(title)}</h1>", "<h2>Claims</h2>", "<ul class=claims>"]
    for claim in summary["claims"]:
        verdict = _verdict(claim["held"])
        body.append(f"<li><b class='{verdict.replace(' ', '-')}'>{e(verdict)}</b> "
                    f"{e(claim['claim'])}: {e(claim['evidence'])}</li>")
    body.append("</ul>")
    for table in summary["tables"]:
        body.append(f"<h2>{e(table['title'])}</h2><table><tr>"
                    + "".join(f"<th>{e(c)}</th>" for c in table["columns"]) + "</tr>")
        for row in table["rows"]:
            body.append("<tr>" + "".join(f"<td>{e(fmt(v))}</td>" for v in row) + "</tr>")
        body.append("</table>")
        if table.get("note"):
            body.append(f"<p class=note>{e(table['note'])}</p>")
    for figure in summary["figures"]:
        data = base64.b64encode((out / figure["file"]).read_bytes()).decode("ascii")
        body.append(f"<figure><img alt='{e(figure['file'])}' src='data:image/png;base64,{data}'>"
                    f"<figcaption>{e(figure['caption'])}</figcaption></figure>")
    machine = record["machine"]
    body.append(f"<p class=note>Measured on {e(str(machine['cpu']))} ({machine['threads']} "
                f"torch threads, {machine['cores']} cores, load average "
                f"{fmt(machine.get('load_average_5min'))} at the end; GPU: {e(str(machine['gpu']))}; "
                f"torch {e(machine['torch'])}). Settings: {e(_settings(record['settings']))}.</p>")
    page = ("<!doctype html><html><head><meta charset=utf-8>"
            f"<title>{e(title)}</title><style>{_STYLE}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")
    path = out / "report.html"
    write_atomic(path, page)
    return path


def _settings(settings: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())


_STYLE = """
body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #ccc;padding:.2rem .6rem;
text-align:right}th{background:#f3f3f3}td:first-child{text-align:left}img{max-width:100%}
.held{color:#176f2c}.did-not-hold{color:#a31515}.inconclusive{color:#8a6d00}
.note{color:#555;font-size:.9rem}figcaption{color:#555;font-size:.9rem}
"""
