"""Beam search inside the engine: the W running continuations are W sequences forked from one
another, sharing the blocks of what they have in common, ranked by generation/beam.py's
BeamRanking once every member has offered its logits. A source chosen twice is forked (copied
on its next write); one no candidate continues gives its blocks back; with stop strings a
candidate's token goes onto a fork of its source's text stream (never decoded again).
"""

from __future__ import annotations

import copy
import itertools
import time

import torch

from ..generation.beam import BeamRanking, Hypothesis
from ..generation.config import GenerationResult
from ..generation.stopping import Decoder, TextStream
from .block_manager import BlockManager
from .requests import result_of
from .scheduler import Scheduler
from .sequence import Sequence, Status


class BeamGroup:
    def __init__(self, seq: Sequence, tokenizer: Decoder | None, context_length: int) -> None:
        self.id, self.root, self.tokenizer, self.context_length = seq.id, seq, tokenizer, context_length
        params = seq.params
        self.ranking = BeamRanking(params.beams, params.length_penalty, params.max_new_tokens,
                                   context_length - seq.prompt_len)
        self.members = [seq]
        self.running = [Hypothesis((), 0.0)]  # each member's generated tokens, their summed log-probs
        self.logits: dict[Sequence, torch.Tensor] = {}
        self._forks = itertools.count(1)
        seq.unit = self
        if not params.stop:
            seq.text = None  # nothing to watch during the search; the winner's text is decoded once

    def offer(self, seq: Sequence, logits: torch.Tensor) -> bool:
        """A member's next-token logits (V,); True once every member has offered."""
        self.logits[seq] = logits
        return all(m in self.logits for m in self.members)

    def forget(self, seq: Sequence) -> None:
        """A member was preempted: the logits it offered come again once it is recomputed."""
        self.logits.pop(seq, None)

    def advance(self, scheduler: Scheduler) -> bool:
        """Rank the candidates: forked members join the scheduler, those no candidate continues
        leave it. True once the search is over (the engine then ends the group)."""
        members, root = self.members, self.root
        if root.first_token_time is None:
            root.first_token_time = time.perf_counter()
        streams: dict[tuple[int, int], TextStream] = {}  # (source, token) -> the candidate's text

        def ends(source: int, token: int) -> bool:
            if token in root.eos:
                return True
            text = members[source].text
            if text is None:
                return False
            streams[source, token] = stream = text.fork()
            stream.push(token)
            return stream.stop_string is not None

        logits = torch.stack([self.logits[m] for m in members])  # (n, V)
        self.logits.clear()
        sources = self.ranking.step(logits, self.running, ends)
        if sources is None:
            return True
        used: set[int] = set()
        continuing = []
        for source in sources:  # forks first, from the members as they were
            member = members[source]
            if source in used:
                member = self._fork(member, scheduler.blocks)
                scheduler.adopt(member)
            used.add(source)
            continuing.append(member)
        for member, source, hypothesis in zip(continuing, sources, self.ranking.survivors, strict=True):
            token = hypothesis.ids[-1]
            member.tokens.append(token)
            member.text = streams.get((source, token))
        self.members, self.running = continuing, self.ranking.survivors
        for i, member in enumerate(members):
            if i not in used:
                scheduler.remove(member)
        return False

    def _fork(self, parent: Sequence, blocks: BlockManager) -> Sequence:
        child = copy.copy(parent)
        child.id = f"{self.id}/beam-{next(self._forks)}"
        child.tokens = list(parent.tokens)
        child.status = Status.RUNNING
        blocks.fork(parent, child)
        return child

    def result(self) -> GenerationResult:
        """The winner's result; with best_beams > 1 the next best beams' under `runners_up`.
        Each beam's tokens are accepted again by a copy of the prompt, so its text and stop
        reason are what a request of one would get."""
        root = self.root
        results = []
        for beam in self.ranking.best(root.params.best_beams):
            # vocab_size 0: a beam counts no tokens (beams take no penalties)
            seq = Sequence(root.tokens[: root.prompt_len], root.params, 0, self.tokenizer, root.id)
            for token in beam.ids:
                seq.accept(token, self.context_length)
            seq.arrival, seq.first_token_time = root.arrival, root.first_token_time
            results.append(result_of(seq))
            results[-1].log_prob = beam.log_prob
        results[0].runners_up = tuple(results[1:])
        return results[0]
