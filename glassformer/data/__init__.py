"""Text that ships with the package: tinyshakespeare (1.1 MB of Shakespeare's plays, in the
public domain, as char-rnn collected it), the corpus of the examples, the tests and
`glassformer experiment`, so that neither a clone nor an installed package needs a folder
beside it."""

from __future__ import annotations

from pathlib import Path


def tinyshakespeare() -> Path:
    """The packaged tinyshakespeare.txt."""
    return Path(__file__).with_name("tinyshakespeare.txt")
