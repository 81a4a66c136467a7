"""The error a caller's own input causes, with what it concerns as data.

`InputError` is a `ValueError` (so the contract "an invalid configuration raises ValueError
naming the field" holds) that carries the field it names (`field`: an OpenAI error body's
`param`, an option's name on the command line) and what kind of mistake it is (`code`). The
server builds its error bodies from these values and the CLI prints them as one line; any
other exception is a bug in Glassformer and keeps its traceback.
"""

from __future__ import annotations

import os


class InputError(ValueError):
    """A mistake in what the caller gave: `field` names the input it concerns (None for the
    input as a whole), `code` the kind of mistake (OpenAI's error `code`)."""

    def __init__(self, field: str | os.PathLike[str] | None, message: str,
                 code: str = "invalid_value") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = str(field) if field else None  # a file's path may come as a Path
        self.code, self.detail = code, message
