"""One entry of a loader's key map: a tensor in a foreign file and where it goes in ours."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """One Hugging Face tensor: our parameter, the block of its rows, whether to transpose, and
    `order`: where ours differs in the order of rows, the foreign row of each of our rows
    (ours = theirs[order], theirs = ours[argsort(order)])."""

    hf: str
    ours: str
    rows: tuple[int, int] | None = None
    transpose: bool = False
    order: tuple[int, ...] | None = None
