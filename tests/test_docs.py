"""The documentation: the site builds with `mkdocs build --strict` (a broken link, anchor or
API reference fails), offline, with the tutorial computed at build time; the README stays
short and its links point at files that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_site_builds_strict(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    site = tmp_path / "site"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    tutorial = (site / "tutorial" / "index.html").read_text()
    assert "blocks.0.attn.pattern" in tutorial and "largest difference" in tutorial
    assert "concat(heads) W_O" in (site / "reference" / "interpret" / "index.html").read_text()
    assert "The rooms" in (site / "architecture" / "index.html").read_text()


def test_readme_is_short_and_its_links_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, missing
