"""The recall tasks: needles (secret numbers of cities) hidden in a haystack of Shakespeare.

    prompt = head + hay[:k] + needle + hay[k:n] + tail          exactly `length` tokens
    head, tail: the chat template around the user's message where the model has one; the tail
    holds the question and starts the answer ("The secret number of Verona is")

The needle asked for starts at token k = round(depth · (n_document − n_needle)) of the
document (depth 0: its first token, 1: it ends the document). Multi-key prompts hide several
needles (other cities, other numbers) at seeded depths and ask for one. Pieces are joined as
token ids, so the length is exact for any tokenizer. A model answers correctly when the
number appears in its answer. A vocabulary without digits (the character
models' Shakespeare has only '3') gets the number spelled digit by digit.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InputError

CITIES = ("Verona", "Padua", "Mantua", "Milan", "Venice", "Florence", "Pisa", "Naples", "Rome",
          "Messina", "Athens", "Ephesus", "Tyre", "Antioch", "Vienna", "Elsinore", "Windsor",
          "Bordeaux", "Orleans", "Rouen", "Harfleur", "Coventry", "York", "Bristol", "Dover",
          "Gloucester", "Salisbury", "Lancaster", "Syracuse", "Corinth", "Sardis", "Philippi")
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SPLIT = "\x00"  # where the document goes in the rendered template (never in the haystack)


@dataclass(frozen=True)
class Needle:
    city: str
    number: int
    spelled: bool = False  # the number as words, for a vocabulary without digits

    @property
    def value(self) -> str:
        return " ".join(DIGITS[int(d)] for d in str(self.number)) if self.spelled else str(self.number)

    @property
    def sentence(self) -> str:
        return f"The secret number of {self.city} is {self.value}."

    @property
    def question(self) -> str:
        return f"What is the secret number of {self.city}?"

    @property
    def answer_start(self) -> str:
        return f"The secret number of {self.city} is"


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    asked: Needle
    starts: list[int]  # where each needle starts in `ids`, the asked one first
    document: tuple[int, int]  # the document's span [start, end) in `ids`


def needles(seed: int, count: int, spelled: bool = False) -> list[Needle]:
    """`count` needles with distinct cities and distinct four-digit numbers."""
    if not 1 <= count <= len(CITIES):
        raise InputError("count", f"needles must number 1..{len(CITIES)}, got {count}")
    rng = random.Random(seed)
    cities = rng.sample(CITIES, count)
    numbers = rng.sample(range(1000, 10000), count)
    return [Needle(c, n, spelled) for c, n in zip(cities, numbers, strict=True)]


def spells_digits(tokenizer) -> bool:
    """Whether the tokenizer cannot write digits (then numbers are spelled)."""
    try:
        return tokenizer.decode(tokenizer.encode("0123456789")) != "0123456789"
    except (ValueError, KeyError, IndexError):
        return True


def frame(tokenizer, needle: Needle) -> tuple[list[int], list[int]]:
    """The ids before and after the document: the chat template (where the tokenizer has one)
    around the user's message, then the start of the answer."""
    message = f"{SPLIT}\n\n{needle.question}"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.render_chat([{"role": "user", "content": message}]) + needle.answer_start
    else:
        text = f"{message}\nAnswer: {needle.answer_start}"
    head, tail = text.split(SPLIT)
    return tokenizer.encode(head), tokenizer.encode(tail)


def haystack_prompt(tokenizer, hay: Sequence[int], hidden: Sequence[Needle], depths: Sequence[float],
                    length: int) -> Prompt:
    """A prompt of exactly `length` tokens: hay ids with `hidden[i]` at `depths[i]` of the
    document; the question asks for `hidden[0]`."""
    if any(not 0.0 <= d <= 1.0 for d in depths) or len(depths) != len(hidden):
        raise InputError("depths", f"one per needle, each in [0, 1]; got {list(depths)}")
    head, tail = frame(tokenizer, hidden[0])
    pieces = [tokenizer.encode(f"\n{n.sentence}\n") for n in hidden]
    n_document = length - len(head) - len(tail)
    n_hay = n_document - sum(len(p) for p in pieces)
    if n_hay < 0:
        raise InputError("length", f"{length} tokens cannot hold the question and {len(hidden)} needles")
    if n_hay > len(hay):
        raise InputError("length", f"the haystack has {len(hay)} tokens, {n_hay} are needed")
    # each needle's start in the document, then in the hay (the needles before it removed)
    wanted = [round(d * (n_document - len(p))) for d, p in zip(depths, pieces, strict=True)]
    order = sorted(range(len(hidden)), key=lambda i: wanted[i])
    ids, starts, taken, placed = list(head), [0] * len(hidden), 0, 0
    for i in order:
        cut = min(max(wanted[i] - placed, taken), n_hay)  # needles never overlap
        ids += hay[taken:cut]
        starts[i] = len(ids)
        ids += pieces[i]
        placed += len(pieces[i])
        taken = cut
    ids += hay[taken:n_hay]
    document = (len(head), len(ids))
    ids += tail
    return Prompt(ids, hidden[0], starts, document)


def recalled(answer: str, needle: Needle) -> bool:
    """Exact match: the needle's number appears in the answer."""
    return needle.value in answer
