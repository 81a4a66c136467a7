"""Reading and writing the user's files carefully: JSON objects that name their file when they
are wrong, outputs that never replace an input or an unknown file, and atomic writes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import InputError


def read_text(path: str | Path) -> str:
    """A UTF-8 text file; a file that is not UTF-8 (or not a regular file) is one clear error."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise InputError(path, "not a regular file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise InputError(path, f"not valid UTF-8 (byte {error.start})") from None


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A JSON file whose top level must be an object."""
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as error:
        raise InputError(path, f"not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise InputError(path, f"expected a JSON object, found a {type(data).__name__}")
    return data


def check_output(output: str | Path, inputs: Iterable[str | Path] = (), force: bool = False) -> Path:
    """Refuse an output that is one of the inputs or lies inside an input folder, (without
    `force`) any file already there, or one `check_location` refuses."""
    output = Path(output)
    for source in inputs:
        source = Path(source)
        if not source.exists():
            continue  # a name (a known model), not a path
        if output.exists() and os.path.samefile(output, source):
            raise InputError(output, f"the output would replace the input {source}")
        if source.is_dir() and output.resolve().is_relative_to(source.resolve()):
            raise InputError(output, f"the output would be written inside the input {source}")
    if output.is_dir():
        raise InputError(output, "is a folder; give a file name")
    if (output.exists() or output.is_symlink()) and not force:
        raise InputError(None, f"{output} already exists; pass --force to replace it")
    return check_location(output)


def check_location(output: str | Path, makes_folders: bool = False) -> Path:
    """Refuse an output that cannot be written where it is asked, before any work: a path
    through a regular file, or a folder to write it in that does not exist (unless the writer
    `makes_folders`, as a run folder or an export does)."""
    output = Path(output)
    for parent in output.absolute().parents:  # the nearest that exists decides
        if parent.exists():
            if not parent.is_dir():
                raise InputError(output, f"{parent} is a file, not a folder")
            break
    if not makes_folders and not output.absolute().parent.is_dir():
        raise InputError(output, "the folder to write it in does not exist")
    return output


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write `data` (text as UTF-8) beside `path`, then rename it into place: no half-written
    file is left."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
