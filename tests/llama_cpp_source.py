"""llama.cpp's own files, for tests that hold Glassformer to llama.cpp: its tokenizer test set
(`models/ggml-vocab-*.gguf` with `.inp` / `.out`: each test text, and llama.cpp's ids for it
without BOS), and its converter from Hugging Face folders (`convert_hf_to_gguf.py` with
`conversion/` and `gguf-py/`).

They come inside llama-cpp-python's source archive on PyPI, fetched once with pip and kept
under `$GLASSFORMER_TEST_CACHE`, else `~/.cache/glassformer-tests` (those files only, about
30 MB). A machine that cannot reach the package index skips these tests, saying why.
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
LLAMA_CPP_MEMBER = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
SEPARATOR = "\n__ggml_vocab_test__\n"


def cache_dir() -> Path:
    root = os.environ.get("GLASSFORMER_TEST_CACHE") or Path.home() / ".cache" / "glassformer-tests"
    return Path(root) / f"llama.cpp-{VERSION}"


def vocab_dir() -> Path:
    """The folder of llama.cpp's ggml-vocab-* files, fetched on first use (or pytest.skip)."""
    return _fetched() / "models"


def converter() -> list[str]:
    """The command that runs llama.cpp's convert_hf_to_gguf.py (fetched on first use, or
    pytest.skip) with this Python; its own gguf-py comes first on the path."""
    return [sys.executable, str(_fetched() / "convert_hf_to_gguf.py")]


def _wanted(relative: str) -> bool:
    """Whether a file of the archive's llama.cpp folder is one the tests use."""
    top = relative.split("/")[0]
    return (relative.startswith("models/ggml-vocab-") and relative.count("/") == 1
            or top in ("gguf-py", "conversion") or relative == "convert_hf_to_gguf.py")


def _fetched() -> Path:
    """llama.cpp's folder with the files `_wanted` names, fetched once."""
    folder = cache_dir()
    if (folder / "complete").is_file():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
               ":all:", f"llama-cpp-python=={VERSION}", "-d", tmp]
        done = subprocess.run(pip, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"llama-cpp-python's source could not be downloaded: {done.stderr[-300:]}")
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                relative = member.name.removeprefix(LLAMA_CPP_MEMBER)
                if member.isfile() and member.name.startswith(LLAMA_CPP_MEMBER) and _wanted(relative):
                    (folder / relative).parent.mkdir(parents=True, exist_ok=True)
                    (folder / relative).write_bytes(tar.extractfile(member).read())
    (folder / "complete").write_text("")
    return folder


def vocab_cases(path: Path) -> list[tuple[str, list[int]]]:
    """Each test text of a ggml-vocab file and llama.cpp's ids for it."""
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split(SEPARATOR)
    ids = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids, strict=False)]
