"""The documentation: the site builds with `mkdocs build --strict` (a broken link, anchor or
API reference fails), offline, with the tutorial computed at build time; the README stays
short and its links point at files that exist."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from glassformer.accel import fast_decode
from glassformer.accel.capabilities import only
from glassformer.formats.families import BY_MODEL_TYPE, FAMILIES

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


def _supported_models():
    spec = importlib.util.spec_from_file_location("supported_models", ROOT / "docs" / "supported_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_supported_models_page_is_the_generated_one():
    generator = _supported_models()
    assert generator.PAGE.read_text() == generator.supported_models_markdown(), \
        "docs/guides/supported-models.md differs from the registry: python docs/supported_models.py"


def _row(page: str, family: str) -> list[str]:
    """A family's cells after its name."""
    line = next(line for line in page.splitlines() if line.startswith(f"| {family} |"))
    return [cell.strip() for cell in line.split("|")[2:-1]]


def test_the_table_follows_the_capability_tables_and_the_registry(monkeypatch):
    generator = _supported_models()
    before = generator.supported_models_markdown()
    fused = 3 + list(generator.PATHS).index("fused decode step")  # after model_type, GGUF, pieces
    assert _row(before, "Gemma 3")[fused] == "yes"
    rules = fast_decode.CAPABILITIES.rules | {"rope_local_theta": only(None, reason="one base")}
    table = dataclasses.replace(fast_decode.CAPABILITIES, rules=rules)
    monkeypatch.setattr(fast_decode, "CAPABILITIES", table)
    llama3 = dataclasses.replace(BY_MODEL_TYPE["llama"], name="Llama 3")
    monkeypatch.setattr(generator, "FAMILIES", (*FAMILIES, llama3))
    after = generator.supported_models_markdown()
    assert _row(after, "Gemma 3")[fused] == "no: `rope_local_theta`"
    assert "Gemma 3: fused decode step" not in before
    assert "- Gemma 3: fused decode step: rope_local_theta=10000.0 is not computed (one base)" in after
    assert _row(after, "Llama 3") == _row(after, "Llama")
