"""A clone with nothing beside it: the corpus the examples, the tests and `glassformer
experiment` read ships inside the package, and nothing reaches for a folder outside the
repository."""

from __future__ import annotations

import re
from pathlib import Path

import glassformer
from glassformer.data import tinyshakespeare
from glassformer.experiments import training_text

ROOT = Path(glassformer.__file__).resolve().parents[1]
# the corpus where the project's own checkout once kept it, beside the clone
OUTSIDE = re.compile(r"""shared/data|["']shared["']\s*/\s*["']data["']""")


def test_the_corpus_is_package_data():
    path = tinyshakespeare()
    assert path.is_file() and path.resolve().is_relative_to(Path(glassformer.__file__).resolve().parent)
    text = path.read_text(encoding="utf-8")
    assert len(text) > 1_000_000 and text.startswith("First Citizen:")
    table = re.search(r"\[tool\.setuptools\.package-data\]\s*glassformer = \[(.*?)\]",
                      (ROOT / "pyproject.toml").read_text(), re.S)
    patterns = re.findall(r'"([^"]+)"', table.group(1))
    relative = path.resolve().relative_to(Path(glassformer.__file__).resolve().parent)
    assert any(relative.match(p) for p in patterns), patterns


def test_experiments_default_to_the_packaged_corpus(tmp_path):
    assert training_text(None) == tinyshakespeare().resolve()
    mine = tmp_path / "mine.txt"
    mine.write_text("to be or not to be\n")
    assert training_text(str(mine)) == mine.resolve()


def test_nothing_reads_a_folder_beside_the_clone():
    sources = [*ROOT.glob("glassformer/**/*.py"), *ROOT.glob("tests/**/*.py"),
               *ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*"), ROOT / "README.md",
               *ROOT.glob("docs/guides/*.md")]
    outside = [f"{p.relative_to(ROOT)}:{n}" for p in sources if p.is_file()
               for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
               if OUTSIDE.search(line) and p.name != "test_hostile_clone.py"]
    assert outside == []
