"""MkDocs hooks: pages whose figures are computed when the site is built.

- `tutorial.md` is written by `docs/tutorial.py`, which runs a small seeded model;
- the marker `<!-- benchmark-records -->` in `performance.md` becomes the tables that
  `benchmarks/tables.py` makes from the records in `benchmarks/results/`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
RECORDS_MARKER = "<!-- benchmark-records -->"


def _importable() -> None:
    for path in (ROOT, ROOT / "docs", ROOT / "benchmarks"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def on_files(files, config):
    _importable()
    from tutorial import tutorial_markdown

    files.append(File.generated(config, "tutorial.md", content=tutorial_markdown()))
    return files


def on_page_markdown(markdown, page, config, files):
    if RECORDS_MARKER not in markdown:
        return markdown
    _importable()
    from tables import records_markdown

    return markdown.replace(RECORDS_MARKER, records_markdown(ROOT / "benchmarks" / "results"))
