"""What the training loop draws its batches from, behind one interface: `train(...)` for the
next optimizer step and `validation(...)` for an evaluation, each batch in the form its
`objective` computes the loss of.

- `TokenBatches`: plain text, as windows of the run's token file (tokens.bin) at random
  starts, turned into the objective's batch (clm, or mlm / span corruption with their masks);
- `ChatBatches`: chat files (.jsonl), as packed conversation windows (chat_data.py), the
  loss counted on the assistant's tokens only.

Every draw takes the run's seeded generator, all processes' rows at once (each process keeps
its slice `mine`), so a run's batches do not depend on how many processes share it. The
validation set is fixed for the run: the same windows at every evaluation, split over the
processes by rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .chat_data import ChatData, ChatSFT
from .data import TokenData, draw_starts, windows
from .objectives import Batch


class TokenBatches:
    def __init__(self, tokens: TokenData, objective, tokenizer, context_length: int,
                 n_val: int, seed: int, rank: int, world_size: int) -> None:
        self.tokens, self.objective, self.tokenizer, self.T = tokens, objective, tokenizer, context_length
        val_starts = draw_starts(len(tokens.val), context_length, n_val,
                                 torch.Generator().manual_seed(seed + 1))  # (n_val,)
        self.val_starts = val_starts[rank::world_size]

    def train(self, generator: torch.Generator, n: int, mine: slice, device: torch.device) -> Batch:
        """The next step's `n` windows (every process's); this process's rows `mine`."""
        starts = draw_starts(len(self.tokens.train), self.T, n, generator)  # (n,)
        x, y = windows(self.tokens.train, starts[mine], self.T, device)
        masks = self.objective.draw_masks(n, self.T, generator)  # every row's, as the starts
        return self.objective.batch(x, y, self.tokenizer, None if masks is None else masks[mine])

    def validation(self, batch_size: int, device: torch.device) -> Iterator[Batch]:
        """This process's validation windows; a random objective draws each window's
        randomness from its start, the same at every evaluation."""
        for chunk in self.val_starts.split(batch_size):
            x, y = windows(self.tokens.val, chunk, self.T, device)
            masks = [self.objective.draw_masks(1, self.T, torch.Generator().manual_seed(int(s)))
                     for s in chunk]
            yield self.objective.batch(x, y, self.tokenizer, None if masks[0] is None else torch.cat(masks))


class ChatBatches:
    objective = ChatSFT()

    def __init__(self, chat: ChatData, n_val: int, rank: int, world_size: int) -> None:
        self.chat = chat
        self.val_rows = torch.arange(min(len(chat.val), n_val))[rank::world_size]  # the first, in order

    def train(self, generator: torch.Generator, n: int, mine: slice, device: torch.device) -> Batch:
        rows = torch.randint(0, len(self.chat.train), (n,), generator=generator)  # (n,)
        return self.chat.train.batch(rows[mine], device)

    def validation(self, batch_size: int, device: torch.device) -> Iterator[Batch]:
        for chunk in self.val_rows.split(batch_size):
            yield self.chat.val.batch(chunk, device)
