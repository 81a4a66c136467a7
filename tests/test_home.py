"""One folder for what Glassformer downloads and builds, chosen by the same rule everywhere."""

from __future__ import annotations

from pathlib import Path

from glassformer.accel import build
from glassformer.formats import hub
from glassformer.home import home


def test_glassformer_home_wins_then_xdg_then_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("GLASSFORMER_HOME", str(tmp_path / "own"))
    assert home() == tmp_path / "own"
    monkeypatch.delenv("GLASSFORMER_HOME")
    assert home() == tmp_path / "xdg" / "glassformer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert home() == tmp_path / "user" / ".cache" / "glassformer"


def test_an_empty_variable_counts_as_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GLASSFORMER_HOME", "")
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert home() == tmp_path / ".cache" / "glassformer"


def test_models_and_kernels_live_under_it(monkeypatch, tmp_path):
    monkeypatch.delenv("GLASSFORMER_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert hub.models_dir() == tmp_path / "glassformer" / "models"
    assert build.cache_dir() == tmp_path / "glassformer" / "kernels"
    monkeypatch.setenv("GLASSFORMER_HOME", "~/gf")
    assert build.cache_dir() == Path("~/gf").expanduser() / "kernels"
