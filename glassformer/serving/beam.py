"""Beam search inside the engine: the W running continuations are W sequences that fork from
one another and share the KV blocks of everything they have in common.

The group waits until every member has its next-token logits, then ranks the candidates as
generation/beam.py does (sum of log-probabilities; a top-W candidate ending in end-of-text or
a stop string is set aside as finished; done once W are finished, at max_new_tokens or at
the end of the window). Each surviving candidate continues its source member; a source
chosen twice is forked (its blocks shared, copied on the next write), and a member no
candidate continues gives its blocks back. Only the winner is reported, at the end.
"""

from __future__ import annotations

import copy
import itertools

import torch

from ..generation.beam import Hypothesis
from ..generation.generate import GenerationResult
from ..generation.stopping import Decoder, TextStream
from .block_manager import BlockManager
from .sequence import Sequence, Status


class BeamGroup:
    def __init__(self, seq: Sequence, tokenizer: Decoder | None, context_length: int) -> None:
        self.id, self.root = seq.id, seq
        self.width, self.penalty = seq.params.beams, seq.params.length_penalty
        self.tokenizer, self.context_length = tokenizer, context_length
        self.members = [seq]
        self.log_probs = {seq: 0.0}  # summed log-probabilities of each member's generated tokens
        self.logits: dict[Sequence, torch.Tensor] = {}
        self.finished: list[Hypothesis] = []
        self.winner: Hypothesis | None = None
        self.window_full = False
        self._forks = itertools.count(1)
        seq.group, seq.text = self, None

    def offer(self, seq: Sequence, logits: torch.Tensor) -> bool:
        """A member's next-token logits (V,); True once every member has offered."""
        self.logits[seq] = logits
        return all(m in self.logits for m in self.members)

    def _ends(self, ids: tuple[int, ...]) -> bool:
        stop = self.root.params.stop
        return ids[-1] in self.root.eos or bool(stop) and any(s in self.tokenizer.decode(list(ids))
                                                              for s in stop)

    def advance(self, blocks: BlockManager) -> tuple[list[Sequence], list[Sequence]]:
        """Rank the candidates; returns (new forked members, members to drop). Sets `winner`
        when the search is over (then every member is to be dropped)."""
        members, W = self.members, self.width
        scores = torch.tensor([self.log_probs[m] for m in members])[:, None]
        totals = scores + torch.stack([self.logits[m] for m in members]).float().log_softmax(-1)
        self.logits.clear()
        V = totals.shape[-1]
        best = torch.topk(totals.flatten(), min(2 * W, totals.numel()))  # best first
        survivors: list[tuple[int, int, float]] = []  # (source member, token, total)
        for rank, (total, flat) in enumerate(zip(best.values.tolist(), best.indices.tolist(), strict=True)):
            source, token = divmod(flat, V)
            ids = tuple(members[source].generated) + (token,)
            if self._ends(ids):
                if rank < W:
                    self.finished.append(Hypothesis(ids, total))
            elif len(survivors) < W:
                survivors.append((source, token, total))
        length = len(members[0].generated) + 1
        done = length >= self.root.params.max_new_tokens
        self.window_full = not done and members[0].prompt_len + length > self.context_length
        if len(self.finished) >= W or not survivors or done or self.window_full:
            pool = list(self.finished)
            if len(self.finished) < W and survivors:
                pool += [Hypothesis(tuple(members[s].generated) + (t,), total) for s, t, total in survivors]
            self.winner = max(pool, key=lambda h: h.score(self.penalty))
            return [], members
        used: set[int] = set()
        continuing, children = [], []
        for source, token, total in survivors:  # forks first, from the members as they were
            parent = members[source]
            member = parent if source not in used else self._fork(parent, blocks)
            if member is not parent:
                children.append(member)
            used.add(source)
            continuing.append((member, token, total))
        for member, token, total in continuing:
            member.tokens.append(token)
            self.log_probs[member] = total
        self.members = [m for m, _, _ in continuing]
        dropped = [m for i, m in enumerate(members) if i not in used]
        for m in dropped:
            del self.log_probs[m]
        return children, dropped

    def _fork(self, parent: Sequence, blocks: BlockManager) -> Sequence:
        child = copy.copy(parent)
        child.id = f"{self.id}/beam-{next(self._forks)}"
        child.tokens = list(parent.tokens)
        child.status = Status.RUNNING
        blocks.fork(parent, child)
        return child

    def result(self, prefill_seconds: float, decode_seconds: float) -> GenerationResult:
        winner, root = self.winner, self.root
        text = stop_string = None
        if self.tokenizer is not None:
            stream = TextStream(self.tokenizer, root.params.stop, root.tokens[: root.prompt_len][-4:])
            for token in winner.ids:
                if token in root.eos or stream.stop_string is not None:
                    break
                stream.push(token)
            stream.flush()
            text, stop_string = stream.text, stream.stop_string
        if winner.ids[-1] in root.eos:
            reason = "eos"
        elif stop_string is not None:
            reason = "stop_string"
        else:
            reason = "context_full" if self.window_full else "max_new_tokens"
        return GenerationResult(
            prompt_ids=root.tokens[: root.prompt_len], generated_ids=list(winner.ids), text=text,
            stop_reason=reason, prefill_seconds=prefill_seconds, decode_seconds=decode_seconds,
            decode_steps=len(winner.ids) - 1, log_prob=winner.log_prob, stop_string=stop_string)
