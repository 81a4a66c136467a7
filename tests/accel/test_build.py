"""The kernel build: one list of translation units, and a cache key that changes with
everything the compiled module depends on."""

from __future__ import annotations

import re
import shutil
import sys

import pytest
import torch

from glassformer.accel import build


def test_every_source_is_its_own_translation_unit():
    names = {path.name for path in build.SOURCES}
    assert {"matvec.cpp", "quantized.cpp", "decode_step.cpp", "train_ops.cpp"} <= names
    assert [path.name for path in build.HEADERS] == ["glassformer.h"]
    for path in build.SOURCES + build.HEADERS:
        included = re.findall(r'#include\s+"([^"]+)"', path.read_text())
        assert all(name.endswith(".h") for name in included), (path.name, included)


@pytest.fixture
def copied_sources(tmp_path, monkeypatch):
    """The sources and header copied, so a test may edit them."""
    folder = tmp_path / "csrc"
    shutil.copytree(build.CSRC, folder)
    monkeypatch.setattr(build, "SOURCES", tuple(folder / p.name for p in build.SOURCES))
    monkeypatch.setattr(build, "HEADERS", tuple(folder / p.name for p in build.HEADERS))
    return folder


def fake_compiler(folder, name, version):
    path = folder / name
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.skipif(sys.platform == "win32", reason="shell-script compilers")
def test_key_changes_with_each_input(copied_sources, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", fake_compiler(tmp_path, "cc-a", "cc 12.2.0"))
    base = build.cache_key()
    keys = {}
    for name in ("quantized.cpp", "glassformer.h"):
        path = copied_sources / name
        text = path.read_text()
        path.write_text(text + "\n")
        keys[name] = build.cache_key()
        path.write_text(text)
    variations = {
        "compiler version": lambda m: m.setenv("CXX", fake_compiler(tmp_path, "cc-b", "cc 13.1.0")),
        "compiler path": lambda m: m.setenv("CXX", fake_compiler(tmp_path, "cc-c", "cc 12.2.0")),
        "python": lambda m: m.setattr(sys, "version", "3.99.0 (other)"),
        "torch": lambda m: m.setattr(torch, "__version__", "9.9.9"),
        "cpu": lambda m: m.setattr(build, "_cpu_flags", lambda: "flags\t: fpu sse2"),
    }
    for name, vary in variations.items():
        with monkeypatch.context() as m:
            vary(m)
            keys[name] = build.cache_key()
    keys["flags"] = build.cache_key("avx2")
    assert build.cache_key() == base  # every change undone: the same key again
    assert len(set(keys.values()) | {base}) == len(keys) + 1, keys


def test_a_build_killed_midway_does_not_block_the_next(tmp_path, monkeypatch):
    """torch's lock file outlives a killed build; the next build must not wait on it forever."""
    from torch.utils import cpp_extension

    directory = tmp_path / "key"
    directory.mkdir()
    (directory / "lock").write_text("")  # left by a build that was killed
    seen = {}

    def fake_load(name, build_directory, **_):
        seen["stale lock"] = (directory / "lock").exists()
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert build._build("glassformer_kernels_test", directory, "native") == "module"
    assert seen == {"stale lock": False}
