"""Token ids -> visible text, piece by piece, with stop strings checked on the decoded text.

Two problems make streaming text harder than streaming ids:
- a character may span several tokens (UTF-8 bytes of byte-level BPE): a piece is released
  only once the decoded text no longer ends in the replacement character U+FFFD;
- a stop string may span several tokens: text that could still be the start of a stop string
  is held back until it either completes the stop string (then it is cut) or cannot anymore.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Protocol

from ..errors import InputError

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDecoder:
    """Decodes one token at a time. `context` (e.g. the prompt's last ids) is decoded along
    with the new ids so tokenizers that drop a leading space at the start of text keep it."""

    def __init__(self, tokenizer: Decoder, context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        context = list(context)
        if context and tokenizer.decode(context).endswith(REPLACEMENT):
            context = []  # the prompt ends inside a character: no usable context
        self.ids = context
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] is decoded context
        self.read_offset = len(context)  # ids[read_offset:] are not released yet

    def push(self, token_id: int) -> str:
        """The new text this token completes ('' while a character is unfinished)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still pending, unfinished characters shown as U+FFFD."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix) :]


class TextStream:
    """Visible text of a generation. `push(id)` returns the newly visible piece; once a stop
    string appears, `stop_string` is set and `text` ends right before it."""

    def __init__(
        self, tokenizer: Decoder, stop: Sequence[str] = (), context: Sequence[int] = ()
    ) -> None:
        if any(not s for s in stop):
            raise InputError("stop", "stop strings must be non-empty")
        self.decoder = IncrementalDecoder(tokenizer, context)
        self.stop = tuple(stop)
        self.text = ""  # decoded so far, including held-back text
        self.emitted = 0  # characters of `text` already returned
        self.stop_string: str | None = None

    def fork(self) -> TextStream:
        """An independent stream in this one's state (a beam's candidates each go on alone);
        no text is decoded again."""
        twin = copy.copy(self)
        twin.decoder = copy.copy(self.decoder)
        twin.decoder.ids = list(self.decoder.ids)
        return twin

    def push(self, token_id: int) -> str:
        if self.stop_string is not None:
            raise InputError("push", "the stream already stopped")
        return self._extend(self.decoder.push(token_id))

    def flush(self) -> str:
        """At the end of generation: release held-back text and unfinished characters."""
        if self.stop_string is not None:
            return ""
        piece = self._extend(self.decoder.flush())
        if self.stop_string is None:  # nothing can complete a stop string anymore
            piece += self.text[self.emitted :]
            self.emitted = len(self.text)
        return piece

    def _extend(self, new: str) -> str:
        longest = max((len(s) for s in self.stop), default=0)
        search_from = max(0, len(self.text) - longest + 1)
        self.text += new
        hit = _first_occurrence(self.text, self.stop, search_from)
        if hit is not None:
            index, self.stop_string = hit
            self.text = self.text[:index]
            safe = index
        else:
            safe = len(self.text) - _pending_prefix(self.text, self.stop)
        piece = self.text[self.emitted : safe]
        self.emitted = max(self.emitted, safe)
        return piece


def _first_occurrence(text: str, stop: Sequence[str], start: int) -> tuple[int, str] | None:
    """The earliest (index, stop string) found in text[start:], or None."""
    hits = [(i, s) for s in stop if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def _pending_prefix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the beginning of some stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
