"""Chat data for supervised fine-tuning: conversations -> packed windows with a loss mask.

A chat file is JSON Lines (`.jsonl`), one conversation per line in OpenAI's shape:
`{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}`.

Each conversation is rendered with the model's own chat template, and the loss counts the
tokens of the assistant turns only. The assistant spans are found by rendering prefixes: for
the assistant message i, the template renders messages[:i] with the generation prompt (text
that ends where the reply begins) and messages[:i+1] without it (text that ends after the reply
and the template's end-of-turn); both must be prefixes of the whole conversation's rendering,
and the text between them is the assistant's turn. The rendering is cut at these boundaries and
each piece tokenized on its own, so the counted tokens are exactly the assistant turns' tokens.

Conversations are packed into windows of T (input, target) pairs, in file order, a new window
starting when the next one does not fit (a longer conversation keeps its first T). Each token
carries its conversation's index within the window (`documents`) and its position within the
conversation, so the model's document mask keeps packed conversations apart and each one sees
exactly what it would see alone. Padding fills a window's tail: end-of-text inputs, ignored
targets, a document of its own. The last `val_fraction` of the conversations (at least one)
are the validation split.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError
from ..formats.tokenizers import HFTokenizer
from .head_loss import language_model_loss
from .masking import IGNORE

ROLES = ("system", "user", "assistant", "tool")


def is_chat_data(sources: Sequence[Path]) -> bool:
    """Chat data is given as .jsonl files (every source, or the run is refused)."""
    chat = [Path(s).suffix == ".jsonl" for s in sources]
    if any(chat) and not all(chat):
        raise InputError("data", "chat files (.jsonl) and text files cannot be mixed in one run")
    return bool(chat) and all(chat)


def read_conversations(path: str | Path) -> list[list[dict[str, str]]]:
    """The conversations of one .jsonl file; one ValueError naming the file and line for the
    first malformed line (not UTF-8, not JSON, not a conversation), and one for a file with no
    assistant turn at all."""
    return [messages for _, messages in _conversations(path)]


def _conversations(path: str | Path) -> list[tuple[str, list[dict[str, str]]]]:
    """(file:line, messages) of each conversation in one .jsonl file (read_conversations)."""
    conversations = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise InputError(where, f"not valid UTF-8 (byte {error.start} of the line)") from None
            if line.strip():
                conversations.append((where, _messages(line, where)))
    if not any(m["role"] == "assistant" for _, c in conversations for m in c):
        raise InputError(path, "no assistant turns (chat fine-tuning learns the assistant's "
                         "replies; each line needs a message with role 'assistant')")
    return conversations


def _messages(line: str, where: str) -> list[dict[str, str]]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise InputError(where, f"not valid JSON ({error.msg})") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise InputError(None, f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}}')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InputError(where, f"messages[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise InputError(where, f"messages[{i}].content must be a string")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


@dataclass(frozen=True)
class Conversation:
    ids: list[int]  # the rendered conversation's tokens
    counted: list[bool]  # True for the tokens of an assistant turn


def render(tokenizer, messages: list[dict[str, str]]) -> Conversation:
    """The conversation through the model's chat template, with its assistant tokens marked."""
    whole = tokenizer.render_chat(messages, add_generation_prompt=False)
    cuts, spans = [0], []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.render_chat(messages[:i], add_generation_prompt=True)
        through = tokenizer.render_chat(messages[: i + 1], add_generation_prompt=False)
        if not (whole.startswith(before) and whole.startswith(through)
                and cuts[-1] <= len(before) <= len(through)):
            raise InputError(None, "chat template: a conversation's prefix does not render as a "
                             "prefix of it, so the assistant turns cannot be found")
        cuts += [len(before), len(through)]
        spans.append(len(cuts) - 2)  # the piece cuts[-2]:cuts[-1] is an assistant turn
    cuts.append(len(whole))
    ids: list[int] = []
    counted: list[bool] = []
    for k in range(len(cuts) - 1):
        # the template writes any BOS itself: no tokenizer-added one
        piece = HFTokenizer.encode(tokenizer, whole[cuts[k]:cuts[k + 1]])
        ids += piece
        counted += [k in spans] * len(piece)
    return Conversation(ids, counted)


@dataclass(frozen=True)
class PackedRows:
    """Windows of packed conversations: four (N, T) int64 tensors."""

    inputs: torch.Tensor  # token ids
    targets: torch.Tensor  # next token where it counts, IGNORE elsewhere
    positions: torch.Tensor  # each token's position within its conversation
    documents: torch.Tensor  # each token's conversation index within its window

    def batch(self, rows: torch.Tensor, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        """(inputs, positions, documents, targets) of the windows `rows` (n,)."""
        return tuple(t[rows].to(device) for t in
                     (self.inputs, self.positions, self.documents, self.targets))

    def __len__(self) -> int:
        return self.inputs.shape[0]


def pack(conversations: Sequence[Conversation], length: int, pad_id: int) -> PackedRows:
    """Conversations packed into windows of `length` (input, target) pairs; those with no
    counted target left after truncation are dropped."""
    rows: list[list[tuple[int, int, int, int]]] = [[]]  # (input, target, position, document)
    for c in conversations:
        n = min(len(c.ids) - 1, length)
        pairs = [(c.ids[j], c.ids[j + 1] if c.counted[j + 1] else IGNORE) for j in range(n)]
        if all(t == IGNORE for _, t in pairs):
            continue
        if len(rows[-1]) + n > length:
            rows.append([])
        document = rows[-1][-1][3] + 1 if rows[-1] else 0
        rows[-1] += [(x, y, j, document) for j, (x, y) in enumerate(pairs)]
    if not rows[-1]:
        raise InputError("data", "no conversation has an assistant token within the context")
    for row in rows:
        pad = length - len(row)
        document = row[-1][3] + 1
        row += [(pad_id, IGNORE, j, document) for j in range(pad)]
    table = torch.tensor(rows, dtype=torch.int64)  # (N, T, 4)
    return PackedRows(*(table[..., i].contiguous() for i in range(4)))


@dataclass(frozen=True)
class ChatData:
    """The training and validation windows of a run's chat files."""

    train: PackedRows
    val: PackedRows

    @classmethod
    def build(cls, sources: Sequence[Path], tokenizer, length: int,
              val_fraction: float) -> ChatData:
        if not getattr(tokenizer, "chat_template", None):
            raise InputError("data", "chat data (.jsonl) is rendered with the model's chat "
                             "template, and this tokenizer has none (start from a chat model "
                             "with --init)")
        if not 0.0 < val_fraction < 1.0:
            raise InputError("val_fraction", f"must be in (0, 1), got {val_fraction}")
        conversations = [_rendered(tokenizer, messages, where) for s in sources
                         for where, messages in _conversations(s)]
        if len(conversations) < 2:
            raise InputError("data", "chat data needs at least two conversations (one for "
                             "validation)")
        n_val = max(1, int(len(conversations) * val_fraction))
        pad = tokenizer.eos_id
        return cls(pack(conversations[:-n_val], length, pad),
                   pack(conversations[-n_val:], length, pad))


def _rendered(tokenizer, messages: list[dict[str, str]], where: str) -> Conversation:
    """render, its errors (the template's own included) naming the file and line."""
    try:
        return render(tokenizer, messages)
    except InputError as error:
        raise InputError(where, error.detail if error.field is None else str(error)) from None


class ChatSFT:
    """The loop's objective on packed chat windows: a batch is (inputs, positions, documents,
    targets), and the loss is the cross-entropy over the counted targets."""

    name = "sft"

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...],
             reduction: str = "mean") -> torch.Tensor:
        x, positions, documents, y = batch
        return language_model_loss(model, x, y, reduction, positions=positions, documents=documents)
