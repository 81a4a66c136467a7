"""Text on disk -> one memory-mapped token file -> random (B, T+1) training windows.

Documents are tokenized once, each followed by the end-of-text token, and written as uint16
(vocabularies up to 65536) or uint32. The last `val_fraction` of the tokens is the validation
split. Windows are drawn with an explicit torch.Generator, so a run is reproducible and can be
resumed exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ..errors import InputError

Documents = Literal["file", "line", "blank"]  # one per file, one per line, blank-line separated
_FLUSH_TOKENS = 1 << 20


def list_sources(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """Text files named by `paths`: files as given, folders as their *.txt files (sorted; the
    other files a folder holds are named in one warning)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    sources: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            found = [p for p in files if p.suffix == ".txt"]
            if not found:
                raise FileNotFoundError(f"no .txt files in folder {path}")
            _warn_skipped(path, [p for p in files if p.suffix != ".txt"])
            sources += found
        elif path.is_file():
            sources.append(path)
        else:
            raise FileNotFoundError(f"data file not found: {path}")
    for source in sources:
        if source.stat().st_size == 0:
            raise InputError(None, f"data file is empty: {source}")
    return sources


def _warn_skipped(folder: Path, skipped: list[Path], shown: int = 8) -> None:
    if skipped:
        names = ", ".join(str(p.relative_to(folder)) for p in skipped[:shown])
        more = f" and {len(skipped) - shown} more" if len(skipped) > shown else ""
        warnings.warn(f"{folder}: skipped {len(skipped)} file(s) not named *.txt: {names}{more}",
                      stacklevel=3)


def iter_documents(sources: Sequence[Path], documents: Documents = "file") -> Iterator[str]:
    """The documents in `sources`, lazily; empty documents are skipped."""
    if documents not in ("file", "line", "blank"):
        raise InputError("documents", f"unknown value {documents!r}; choose file, line or blank")
    for source in sources:
        try:
            yield from _documents(Path(source), documents)
        except UnicodeDecodeError as error:
            raise InputError(source, f"not valid UTF-8 ({error.reason}); the data must be text") from None


def _documents(source: Path, documents: Documents) -> Iterator[str]:
    if documents == "line":
        with open(source, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield line.rstrip("\n")
        return
    text = source.read_text(encoding="utf-8")
    parts = [text] if documents == "file" else re.split(r"\n(?:[ \t]*\n)+", text)
    yield from (part for part in parts if part.strip())


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _fingerprint(sources: Sequence[Path], documents: str, tokenizer_json: str) -> str:
    h = hashlib.sha256(tokenizer_json.encode("utf-8"))
    h.update(documents.encode())
    for source in sources:
        stat = source.stat()
        h.update(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return h.hexdigest()


def write_token_file(sources: Sequence[Path], tokenizer, path: str | Path,
                     documents: Documents = "file") -> None:
    """Tokenize every document into `path` (raw uint16/uint32, each document + EOT), with
    `path`.json describing it. Skipped when the description already matches the inputs."""
    path = Path(path)
    meta_path = path.with_suffix(".json")
    tok_json = json.dumps(_tokenizer_dict(tokenizer), sort_keys=True)
    fingerprint = _fingerprint(sources, documents, tok_json)
    if path.is_file() and meta_path.is_file() and _recorded_fingerprint(meta_path) == fingerprint:
        return
    dtype = token_dtype(tokenizer.vocab_size)
    eot = np.array([tokenizer.eos_id], dtype=dtype)
    tmp = path.with_name(path.name + ".tmp")
    n_tokens, pending, n_pending = 0, [], 0
    with open(tmp, "wb") as f:
        for doc in iter_documents(sources, documents):
            pending += [tokenizer.encode_array(doc).astype(dtype), eot]
            n_pending += len(pending[-2]) + 1
            if n_pending >= _FLUSH_TOKENS:
                f.write(np.concatenate(pending).tobytes())
                n_tokens, pending, n_pending = n_tokens + n_pending, [], 0
        if pending:
            f.write(np.concatenate(pending).tobytes())
            n_tokens += n_pending
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    meta = {"dtype": dtype.name, "n_tokens": n_tokens, "documents": documents,
            "sources": [str(s) for s in sources], "fingerprint": fingerprint}
    partial = meta_path.with_name(meta_path.name + ".tmp")
    partial.write_text(json.dumps(meta, indent=1))
    os.replace(partial, meta_path)  # the description last, whole: a killed run leaves none


def _recorded_fingerprint(meta_path: Path) -> str | None:
    """The fingerprint a token file's description records; None where it is torn (a run killed
    while writing it) or holds none: the tokens are made again."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return None
    return meta.get("fingerprint") if isinstance(meta, dict) else None


def _tokenizer_dict(tokenizer) -> dict:
    if hasattr(tokenizer, "to_dict"):
        return tokenizer.to_dict()
    return json.loads(tokenizer.tokenizer.to_str())


@dataclass
class TokenData:
    """A token file split into train (head) and validation (tail) memory maps."""

    train: np.ndarray  # (n_train,) uint16/uint32 memmap
    val: np.ndarray  # (n_val,)

    @classmethod
    def open(cls, path: str | Path, context_length: int, val_fraction: float = 0.1) -> TokenData:
        path = Path(path)
        meta = json.loads(path.with_suffix(".json").read_text())
        if meta["n_tokens"] == 0:
            raise InputError(None, f"no tokens in {path}")
        tokens = np.memmap(path, dtype=meta["dtype"], mode="r", shape=(meta["n_tokens"],))
        if not 0.0 < val_fraction < 1.0:
            raise InputError("val_fraction", f"must be in (0, 1), got {val_fraction}")
        n_val = int(len(tokens) * val_fraction)
        data = cls(tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:])
        for name, split in (("training", data.train), ("validation", data.val)):
            if len(split) < context_length + 1:
                raise InputError(None,
                    f"corpus too short: the {name} split has {len(split)} tokens, one window "
                    f"needs context_length + 1 = {context_length + 1} "
                    f"({len(tokens)} tokens in all, {val_fraction:.0%} for validation)"
                )
        return data


def draw_starts(n_tokens: int, context_length: int, n: int,
                generator: torch.Generator) -> torch.Tensor:
    """`n` random window starts, each leaving room for context_length + 1 tokens."""
    return torch.randint(0, n_tokens - context_length, (n,), generator=generator)  # (n,)


def windows(tokens: np.ndarray, starts: torch.Tensor, context_length: int,
            device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets at `starts`: two contiguous int64 tensors (n, T)."""
    idx = starts.numpy()[:, None] + np.arange(context_length + 1)  # (n, T+1)
    w = torch.from_numpy(tokens[idx].astype(np.int64))  # (n, T+1)
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (n, T) each
    if torch.device(device).type != "cpu":
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device)
    return x, y
