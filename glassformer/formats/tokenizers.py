"""Tokenizers: character-level, byte-level BPE, and any Hugging Face `tokenizer.json`.

Every tokenizer has `encode(text) -> list[int]`, `encode_array(text) -> np.ndarray`,
`decode(ids) -> str`, `vocab_size`, `eos_id`, `bos_id`, `mask_id` (or None), `end_ids` (the ids
that end a generated text) and `save(path)`.
`encode_sequence(text)` adds the special tokens a tokenizer.json's post-processor names (BERT's
[CLS] ... [SEP]); elsewhere it is `encode`.
`load_tokenizer(path)` reads either file format back:

- character level: `{"type": "char", "chars": "<every character, sorted>", "eos_token": "..."}`;
  id i is `chars[i]`, and the end-of-text token comes next (id = len(chars)). A tokenizer made
  for masked-LM training also has `"mask_token": "[MASK]"`: one more id (len(chars) + 1),
  written `[MASK]` in text (the five characters never stand for themselves there).
- anything else is a Hugging Face `tokenizers` file (our byte-level BPE is saved this way).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..errors import InputError
from .files import read_json_object

EOT = "<|endoftext|>"
MASK = "[MASK]"
# Used when a tokenizer.json comes without a tokenizer_config.json naming its special tokens.
_EOS_CANDIDATES = (EOT, "</s>", "<|end_of_text|>", "<eos>")
_MASK_CANDIDATES = (MASK, "<mask>")


class CharTokenizer:
    """One id per character seen in the corpus, plus an end-of-text token (and a mask token)."""

    def __init__(self, chars: str, eos_token: str = EOT, mask_token: str | None = None):
        if len(set(chars)) != len(chars):
            raise InputError("chars", "characters must be unique")
        if mask_token is not None and (not isinstance(mask_token, str) or len(mask_token) < 2):
            raise InputError("mask_token", f"expected a text of two or more characters, got {mask_token!r}")
        self.chars = "".join(sorted(chars))
        self.eos_token, self.mask_token = eos_token, mask_token
        self._codes = np.array([ord(c) for c in self.chars], dtype=np.uint32)  # sorted

    @classmethod
    def train(cls, documents: Iterable[str]) -> CharTokenizer:
        seen: set[str] = set()
        for doc in documents:
            seen.update(doc)
        if not seen:
            raise InputError(None, "cannot build a character vocabulary from an empty corpus")
        return cls("".join(seen))

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + (2 if self.mask_token else 1)

    @property
    def mask_id(self) -> int | None:
        return len(self.chars) + 1 if self.mask_token else None

    def encode_sequence(self, text: str) -> list[int]:
        return self.encode(text)

    @property
    def eos_id(self) -> int:
        return len(self.chars)

    @property
    def end_ids(self) -> frozenset[int]:
        return frozenset({self.eos_id})

    @property
    def bos_id(self) -> None:
        return None

    def encode_array(self, text: str) -> np.ndarray:
        if self.mask_token and self.mask_token in text:
            parts = [self._encode_chars(part) for part in text.split(self.mask_token)]
            mask = np.array([self.mask_id], dtype=np.int64)
            return np.concatenate([x for part in parts for x in (part, mask)][:-1])
        return self._encode_chars(text)

    def _encode_chars(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)  # (n_chars,)
        ids = np.searchsorted(self._codes, codes)
        known = ids < len(self._codes)
        known[known] = self._codes[ids[known]] == codes[known]
        if not known.all():
            bad = chr(int(codes[np.argmin(known)]))
            raise InputError(None, f"character {bad!r} is not in the tokenizer's vocabulary")
        return ids.astype(np.int64)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        special = {self.eos_id: self.eos_token, self.mask_id: self.mask_token}
        return "".join(special[i] if i in special else self.chars[i] for i in ids)

    def to_dict(self) -> dict:
        out = {"type": "char", "chars": self.chars, "eos_token": self.eos_token}
        return out | ({"mask_token": self.mask_token} if self.mask_token else {})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(data["chars"], data.get("eos_token", EOT), data.get("mask_token"))


class HFTokenizer:
    """Wraps a Hugging Face `tokenizers.Tokenizer` (any tokenizer.json)."""

    def __init__(self, tokenizer: Tokenizer, eos_token: str | None = None,
                 bos_token: str | None = None):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        if eos_token is None:
            eos_token = next((t for t in _EOS_CANDIDATES if t in vocab), None)
        for name, token in (("eos_token", eos_token), ("bos_token", bos_token)):
            if token is not None and token not in vocab:
                raise InputError(name, f"{token!r} is not in the vocabulary")
        self.eos_token, self.bos_token = eos_token, bos_token
        self._eos_id = None if eos_token is None else vocab[eos_token]
        self._bos_id = None if bos_token is None else vocab[bos_token]
        self.mask_token = next((t for t in _MASK_CANDIDATES if t in vocab), None)
        self.mask_id = None if self.mask_token is None else vocab[self.mask_token]

    @classmethod
    def train_bpe(cls, documents: Iterable[str], vocab_size: int) -> HFTokenizer:
        """Byte-level BPE (GPT-2 style) with `<|endoftext|>` as its one special token."""
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet) + 1:
            raise InputError("vocab_size",
                f"byte-level BPE needs at least {len(alphabet) + 1} "
                f"(256 bytes + end-of-text), got {vocab_size}"
            )
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=alphabet,
            show_progress=False,
        )
        tokenizer.train_from_iterator(documents, trainer)
        return cls(tokenizer, eos_token=EOT)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def end_ids(self) -> frozenset[int]:
        """The ids that end a generated text: EOS (a ChatTokenizer adds end-of-turn tokens)."""
        return frozenset() if self._eos_id is None else frozenset({self._eos_id})

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_sequence(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        self.tokenizer.save(str(path))

    @classmethod
    def load(cls, path: str | Path, eos_token: str | None = None,
             bos_token: str | None = None) -> HFTokenizer:
        return cls(read_tokenizer(path), eos_token, bos_token)


def train_tokenizer(kind: str, documents: Iterable[str], vocab_size: int | None = None):
    """A new tokenizer of `kind` ("char" or "bpe") learned from `documents`."""
    if kind == "char":
        return CharTokenizer.train(documents)
    if kind == "bpe":
        if vocab_size is None:
            raise InputError("vocab_size", "byte-level BPE needs a vocabulary size")
        return HFTokenizer.train_bpe(documents, vocab_size)
    raise InputError("tokenizer", f"unknown kind {kind!r}; choose 'char' or 'bpe'")


def load_tokenizer(path: str | Path, eos_token: str | None = None,
                   bos_token: str | None = None) -> CharTokenizer | HFTokenizer:
    """Read a tokenizer.json (ours or Hugging Face's). Special tokens of a Hugging Face file
    come from the arguments, else from a `tokenizer_config.json` beside it, else from the
    usual end-of-text names."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer file at {path}")
    data = read_json_object(path)
    if data.get("type") == "char":
        if not isinstance(data.get("chars"), str):
            raise InputError(path, "a character tokenizer lacks its \"chars\" string")
        return CharTokenizer(data["chars"], data.get("eos_token", EOT), data.get("mask_token"))
    side = path.with_name("tokenizer_config.json")
    if side.is_file():
        config = read_json_object(side)
        eos_token = eos_token or token_text(config.get("eos_token"))
        bos_token = bos_token or token_text(config.get("bos_token"))
    return HFTokenizer.load(path, eos_token, bos_token)


def read_tokenizer(path: Path) -> Tokenizer:
    """A Hugging Face tokenizer.json; a file the tokenizers library cannot read is one error."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # the library raises bare Exceptions
        reason = (str(error).splitlines() or ["unknown error"])[0]
        raise InputError(path, f"not a readable tokenizer ({reason})") from None


def token_text(value) -> str | None:
    # tokenizer_config.json writes a special token as a string or as {"content": ...}.
    return value.get("content") if isinstance(value, dict) else value
