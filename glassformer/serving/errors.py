"""What the engine refuses by its own state, as types (the caller's input errors are
`InputError`s, errors.py): the server answers each with its status and code (serving/api), the
command line with one line."""

from __future__ import annotations

from ..errors import InputError


class EngineStopped(RuntimeError):
    """The engine takes no more requests: it was closed, or a failed step stopped it
    (`Engine.raise_error` re-raises why)."""


class UnknownAdapter(InputError):
    """No LoRA adapter of the name a request or an unload gives is loaded."""


class AdapterInUse(InputError):
    """An adapter that unfinished requests still use cannot be unloaded."""
