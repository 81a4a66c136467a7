"""llama.cpp's own files, for tests that hold Glassformer to llama.cpp: its tokenizer test set
(`models/ggml-vocab-*.gguf` with `.inp` / `.out`: each test text, and llama.cpp's ids for it
without BOS).

They come inside llama-cpp-python's source archive on PyPI, fetched once with pip and kept
under `$GLASSFORMER_TEST_CACHE`, else `~/.cache/glassformer-tests` (the vocabularies only,
about 30 MB). A machine that cannot reach the package index skips these tests, saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

VERSION = "0.3.36"
VOCAB_MEMBER = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/"
SEPARATOR = "\n__ggml_vocab_test__\n"


def cache_dir() -> Path:
    root = os.environ.get("GLASSFORMER_TEST_CACHE") or Path.home() / ".cache" / "glassformer-tests"
    return Path(root) / f"llama.cpp-{VERSION}"


def vocab_dir() -> Path:
    """The folder of llama.cpp's ggml-vocab-* files, fetched on first use (or pytest.skip)."""
    folder = cache_dir() / "models"
    if (folder / "complete").is_file():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
               ":all:", f"llama-cpp-python=={VERSION}", "-d", tmp]
        done = subprocess.run(pip, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"llama-cpp-python's source could not be downloaded: {done.stderr[-300:]}")
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if member.isfile() and member.name.startswith(VOCAB_MEMBER) and "/" not in \
                        member.name[len(VOCAB_MEMBER):] and name.startswith("ggml-vocab-"):
                    (folder / name).write_bytes(tar.extractfile(member).read())
    (folder / "complete").write_text("")
    return folder


def vocab_cases(path: Path) -> list[tuple[str, list[int]]]:
    """Each test text of a ggml-vocab file and llama.cpp's ids for it."""
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split(SEPARATOR)
    ids = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids, strict=False)]
