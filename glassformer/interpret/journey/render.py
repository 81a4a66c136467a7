"""The report: the collected data written into the page template, one self-contained file."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ...formats.files import write_atomic

PLACEHOLDER = "/*JOURNEY_DATA*/"


def render_html(data: dict) -> str:
    """The HTML page (inline CSS and JS, no network) showing `data` from collect_journey."""
    template = resources.files(__package__).joinpath("template.html").read_text(encoding="utf-8")
    payload = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    payload = payload.replace("<", "\\u003c")  # no "</script>" or "<!--" can end the block early
    return template.replace(PLACEHOLDER, payload, 1)


def write_html(data: dict, path: str | Path) -> Path:
    return write_atomic(path, render_html(data))


def summary(data: dict) -> dict:
    """The machine-readable part: tokens, every site's shape/dims/stats, and the predictions."""
    return {
        "tokens": data["tokens"],
        "ids": data["ids"],
        "sites": [{k: site[k] for k in ("name", "shape", "dims", "stats")} for site in data["sites"]],
        "next_tokens": data["next_tokens"],
        "logit_lens": [row["tokens"][-1] for row in data["logit_lens"]],
        "attribution": data["attribution"],
    }
