"""Beam search inside the engine: the W running continuations are W sequences forked from one
another, sharing the blocks of what they have in common, ranked by generation/beam.py's
BeamRanking once every member has offered its logits. A source chosen twice is forked (copied
on its next write); one no candidate continues gives its blocks back; with stop strings a
candidate's token goes onto a fork of its source's text stream (never decoded again).
"""


from __future__ import annotations

import copy
import itertools

import torch

from ..generation.beam import BeamRanking, Hypothesis
from ..generation.config import GenerationResult
from ..generation.stopping import Decoder, TextStream
from .block_manager import BlockManager
from .sequence import Sequence, Status


class BeamGroup:
    def __init__(self, seq: Sequence, tokenizer: Decoder | None, context_length: int) -> None:
        self.id, self.root, self.tokenizer = seq.id, seq, tokenizer
        params = seq.params
        self.ranking = BeamRanking(params.beams, params.length_penalty, params.max_new_tokens,
                                   context_length - seq.prompt_len)
        self.members = [seq]
        self.log_probs = {seq: 0.0}  # summed log-probabilities of each member's generated tokens
        self.logits: dict[Sequence, torch.Tensor] = {}
        self.winner: Hypothesis | None = None
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

    def advance(self, blocks: BlockManager) -> tuple[list[Sequence], list[Sequence]]:
        """Rank the candidates; returns (new forked members, members to drop). Sets `winner`
        when the search is over (then every member is to be dropped)."""
        members = self.members
        streams: dict[tuple[int, int], TextStream] = {}  # (source, token) -> the candidate's text

        def ends(source: int, token: int) -> bool:
            if token in self.root.eos:
                return True
            text = members[source].text
            if text is None:
                return False
            streams[source, token] = stream = text.fork()
            stream.push(token)
            return stream.stop_string is not None

        running = [Hypothesis(tuple(m.generated), self.log_probs[m]) for m in members]
        logits = torch.stack([self.logits[m] for m in members])  # (n, V)
        self.logits.clear()
        sources = self.ranking.step(logits, running, ends)
        if sources is None:
            self.winner = self.ranking.winner()
            return [], members
        used: set[int] = set()
        continuing, children = [], []
        for source in sources:  # forks first, from the members as they were
            parent = members[source]
            member = parent if source not in used else self._fork(parent, blocks)
            if member is not parent:
                children.append(member)
            used.add(source)
            continuing.append(member)
        for member, source, hypothesis in zip(continuing, sources, self.ranking.survivors, strict=True):
            token = hypothesis.ids[-1]
            member.tokens.append(token)
            member.text = streams.get((source, token))
            self.log_probs[member] = hypothesis.log_prob
        self.members = continuing
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
        """The winner's result; with best_beams > 1 the next best beams' under `runners_up`."""
        best = self.ranking.best(self.root.params.best_beams)
        first, *rest = (self._result_of(h, prefill_seconds, decode_seconds) for h in best)
        first.runners_up = tuple(rest)
        return first

    def _result_of(self, beam: Hypothesis, prefill_seconds: float, decode_seconds: float) -> GenerationResult:
        root = self.root
        text = stop_string = None
        if self.tokenizer is not None:
            stream = TextStream(self.tokenizer, root.params.stop, root.tokens[: root.prompt_len][-4:])
            for token in beam.ids:
                if token in root.eos or stream.stop_string is not None:
                    break
                stream.push(token)
            stream.flush()
            text, stop_string = stream.text, stream.stop_string
        if beam.ids[-1] in root.eos:
            reason = "eos"
        elif stop_string is not None:
            reason = "stop_string"
        else:
            reason = "context_full" if self.ranking.window_full else "max_new_tokens"
        return GenerationResult(
            prompt_ids=root.tokens[: root.prompt_len], generated_ids=list(beam.ids), text=text,
            stop_reason=reason, prefill_seconds=prefill_seconds, decode_seconds=decode_seconds,
            decode_steps=len(beam.ids) - 1, log_prob=beam.log_prob, stop_string=stop_string)
