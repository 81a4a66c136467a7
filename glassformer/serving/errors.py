"""The engine's refusals as types, beside the caller's other input errors (`InputError`s): the
server answers each with its status and code, the command line with one line."""

from __future__ import annotations

from ..errors import InputError


class EngineStopped(RuntimeError):
    """The engine takes no more requests: it was closed, or a failed step stopped it
    (`Engine.raise_error` re-raises why)."""


class CapacityError(InputError):
    """A request larger than the whole KV pool: it could never run, so it is refused at once
    (naming what makes it too large: `beams`, `prompt` or `max_new_tokens`)."""


class UnknownAdapter(InputError):
    """No LoRA adapter of the name a request or an unload gives is loaded."""


class AdapterInUse(InputError):
    """An adapter that unfinished requests still use cannot be unloaded."""
