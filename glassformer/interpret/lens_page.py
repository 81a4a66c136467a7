"""A lens as plain data (for JSON) and as one self-contained HTML heat map of layers × tokens."""

from __future__ import annotations

import html
from collections.abc import Callable

from .lens import Lens


def lens_data(lens: Lens, ids: list[int], token_text: Callable[[int], str], tuned: bool) -> dict:
    """The first row of `lens` as {"tokens", "ids", "tuned", "layers": [{"site", "top":
    [per position: [{"id", "token", "prob"}, ...k]]}]}, sites first to last."""
    return {
        "tokens": [token_text(i) for i in ids],
        "ids": ids,
        "tuned": tuned,
        "layers": [
            {"site": site,
             "top": [[{"id": int(i), "token": token_text(int(i)), "prob": round(float(p), 4)}
                      for i, p in zip(top_ids, top_probs, strict=True)]
                     for top_ids, top_probs in zip(site_ids[0], site_probs[0], strict=True)]}
            for site, site_ids, site_probs in zip(lens.sites, lens.ids, lens.probs, strict=True)
        ],
    }


def _visible(token: str) -> str:
    return html.escape(token.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥"))


def _cell(top: list[dict]) -> str:
    p = top[0]["prob"]
    # white to deep blue as the top token's probability goes from 0 to 1
    style = f"background:hsl(215,80%,{100 - 62 * p:.0f}%);color:{'#fff' if p > 0.55 else '#111'}"
    tip = html.escape("\n".join(f"{t['token']!r} {t['prob']:.3f}" for t in top), quote=True)
    return f'<td style="{style}" title="{tip}">{_visible(top[0]["token"])}<small>{p:.2f}</small></td>'


def render_html(data: dict) -> str:
    """One HTML page (no scripts, no network): a row per residual stream, the last block's on
    top, a column per input token; each cell the top token read out there, shaded by its
    probability, the top-k in its tooltip."""
    kind = "Tuned lens" if data["tuned"] else "Logit lens"
    head = "".join(f"<th>{_visible(t)}</th>" for t in data["tokens"])
    rows = "".join(
        f"<tr><th>{html.escape(layer['site'])}</th>{''.join(_cell(top) for top in layer['top'])}</tr>"
        for layer in reversed(data["layers"])
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{kind}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #ddd; padding: 3px 6px; white-space: nowrap; }}
td small {{ display: block; font-size: 10px; opacity: .8; }}
thead th {{ background: #f4f4f4; }} tbody th {{ text-align: right; font-weight: normal; }}
</style></head><body>
<h1>{kind}</h1>
<p>Each cell: the most probable next token read out of that residual stream (rows, the
model's output on top) at that input position (columns), shaded by its probability. Hover a
cell for the top {len(data["layers"][0]["top"][0])}.</p>
<table><thead><tr><th>site \\ token</th>{head}</tr></thead><tbody>{rows}</tbody></table>
</body></html>
"""
