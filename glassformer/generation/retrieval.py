"""Retrieval as the fallback for a document longer than the window: attend only to the
chunks that answer the question.

    document ─tokenizer─▶ ids ─cut─▶ chunks c_1 … c_n of `chunk_tokens` tokens each, each
        starting `chunk_tokens − overlap` after the last (a fact of up to overlap + 1 tokens
        lies whole in some chunk)
    rank the chunks against the question q, keep the best that fit, in document order:
        prompt = c_(i1) ∪ … ∪ c_(ik) + q      i1 < … < ik, |prompt| ≤ the window
    (kept neighbours are joined without repeating their overlap; gaps are marked)

Two rankings, and their fusion:
- BM25 (the `bm25s` library, its Lucene variant) over the chunks' words (lower-cased runs of
  two or more letters or digits, English stop words dropped). Over the query's words t,
      score(c) = Σ_t idf(t) · f(t, c) / (f(t, c) + k1 · (1 − b + b · |c| / avgdl))
  with f(t, c) the count of t in c, |c| the chunk's words, avgdl their mean over the chunks,
  k1 = 1.5, b = 0.75 and idf(t) = ln(1 + (n − n_t + 0.5) / (n_t + 0.5)), n_t of the n chunks
  holding t: rare words that recur in a chunk count most, common words little.
- The model's own embedding: the final hidden states of a text, mean-pooled over its
  tokens, e(x) = (1/T) Σ_t h_t(x) (d,), and the chunk's score is the cosine
      cos(c, q) = e(c) · e(q) / (‖e(c)‖ ‖e(q)‖).
  Chunks of one length are embedded together, EMBED_BATCH per forward pass. A chunk's
  embedding depends on its token ids alone, so a caller that asks about the same text again
  (the same document under other questions) passes a dict that keeps them by their ids.
- "both": the two orders interleaved, BM25's first, the embedding's first, BM25's second ...
  (a chunk met again is skipped; the embedding's alone where BM25 finds no word to match),
  so each ranking's best chunks are kept whatever the other makes of them. (Fusing ranks,
  1 / (60 + rank_bm25) + 1 / (60 + rank_emb), lets chunks both
  rank middling pass the one BM25 puts first: a small model's mean-pooled states rank a
  needle's chunk anywhere, and a prompt of a few chunks then loses it.)
Chunks are taken best first while their tokens fit the room the window leaves; the prompt is
then built and checked, and the lowest-ranked chunk dropped until it fits (a kept
neighbour's overlap is counted twice until then).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError
from ..model.transformer import Transformer

RANKINGS = ("bm25", "embedding", "both")
EMBED_BATCH = 16  # chunks of one length embedded per forward pass
SEPARATOR = "\n...\n"  # between chunks that were not neighbours (ASCII: any vocabulary writes it)


@dataclass(frozen=True)
class Retrieved:
    ids: list[int]  # the prompt's token ids
    chunks: list[int]  # the chunks kept, in document order
    n_chunks: int  # the chunks the document was cut into
    order: list[int]  # every chunk, best first


def spans(n_tokens: int, chunk_tokens: int, overlap: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a document of `n_tokens`: `chunk_tokens` long (the last
    may be shorter), each sharing `overlap` tokens with the one before."""
    if chunk_tokens < 1:
        raise InputError("chunk_tokens", f"must be at least 1, got {chunk_tokens}")
    if not 0 <= overlap < chunk_tokens:
        raise InputError("overlap", f"must be in [0, chunk_tokens), got {overlap}")
    stride = chunk_tokens - overlap
    return [(i, min(i + chunk_tokens, n_tokens)) for i in range(0, max(n_tokens - overlap, 1), stride)]


def bm25_scores(chunks: Sequence[str], question: str) -> np.ndarray | None:
    """BM25 score (n,) of each chunk's text for the question's words; None where there is
    nothing to match (no word in the question, or in any chunk)."""
    import bm25s

    corpus = bm25s.tokenize(list(chunks), stopwords="en", show_progress=False)
    words = bm25s.tokenize([question], stopwords="en", return_ids=False, show_progress=False)[0]
    if not words or not any(corpus.ids):
        return None
    index = bm25s.BM25()
    index.index(corpus, show_progress=False)
    return np.asarray(index.get_scores(words), dtype=np.float64)


@torch.no_grad()
def embeddings(model: Transformer, chunks: Sequence[Sequence[int]],
               cache: dict[tuple[int, ...], torch.Tensor] | None = None) -> torch.Tensor:
    """The mean of the model's final hidden states over each chunk's tokens, each chunk read
    alone: (n, d). `cache` (token ids → (d,)) keeps them for the next call with this model."""
    cache = {} if cache is None else cache
    missing = sorted({tuple(c) for c in chunks} - cache.keys(), key=len)
    device = model.embed.tokens.weight.device
    for _, same in itertools.groupby(missing, key=len):
        same = list(same)
        for i in range(0, len(same), EMBED_BATCH):
            batch = same[i:i + EMBED_BATCH]
            hidden = model.forward_hidden(torch.tensor(batch, device=device))  # (b, T, d)
            cache.update(zip(batch, hidden.float().mean(dim=1).cpu(), strict=True))  # (b, d)
    return torch.stack([cache[tuple(c)] for c in chunks])  # (n, d)


def embedding_scores(model: Transformer, chunks: Sequence[Sequence[int]], question: Sequence[int],
                     cache: dict[tuple[int, ...], torch.Tensor] | None = None) -> np.ndarray:
    """Cosine (n,) between each chunk's mean-pooled hidden state and the question's."""
    q = embeddings(model, [question])  # (1, d)
    c = embeddings(model, chunks, cache)  # (n, d)
    return torch.nn.functional.cosine_similarity(c, q, dim=-1).double().numpy()


def interleaved(*orders: Sequence[int]) -> list[int]:
    """The orders' first items, then their second ..., each item once (orders of one set)."""
    out: dict[int, None] = {}
    for tier in zip(*orders, strict=True):
        out.update(dict.fromkeys(tier))
    return list(out)


def rank(model: Transformer, tokenizer, chunks: Sequence[Sequence[int]], question: str,
         ranking: str, cache: dict[tuple[int, ...], torch.Tensor] | None = None) -> list[int]:
    """Chunk indices, best first, by `ranking` (one of RANKINGS); `cache`: embeddings'."""
    if ranking not in RANKINGS:
        raise InputError("ranking", f"choose one of {', '.join(RANKINGS)}, got {ranking!r}")
    scores = []
    if ranking in ("bm25", "both"):  # "both" without words to match: the embedding's order
        bm25 = bm25_scores([tokenizer.decode(c) for c in chunks], question)
        if bm25 is None and ranking == "bm25":
            raise InputError("ranking", "BM25 finds no word to match in the question or in the "
                             "document's chunks (words: two or more letters or digits, stop "
                             "words dropped); rank by embedding, or give longer chunks")
        scores += [] if bm25 is None else [bm25]
    if ranking in ("embedding", "both"):
        scores.append(embedding_scores(model, chunks, tokenizer.encode(question), cache))
    return interleaved(*(np.argsort(-score, kind="stable").tolist() for score in scores))


def retrieve(model: Transformer, tokenizer, document: str, question: str,
             build: Callable[[str], list[int]], limit: int, chunk_tokens: int = 256,
             ranking: str = "both", cache: dict[tuple[int, ...], torch.Tensor] | None = None,
             ) -> Retrieved:
    """The prompt `build(context)` whose context is the document's best chunks (in document
    order, neighbours overlapping by a quarter) and whose length is at most `limit` tokens.
    `build` writes the question after the context (and any chat template around both);
    `cache` keeps the chunks' embeddings across calls with the same model (see embeddings)."""
    if not document.strip():
        raise InputError("document", "empty; retrieval needs text to cut into chunks")
    if not question.strip():
        raise InputError("question", "empty; the document's chunks are ranked against it")
    room = limit - len(build(""))
    if room < 1:
        raise InputError("limit", f"{limit} tokens leave no room for the document beside the question")
    if chunk_tokens > room:
        raise InputError("chunk_tokens", f"{chunk_tokens} exceed the {room} tokens the window "
                         "leaves for the document")
    ids = tokenizer.encode(document)
    cuts = spans(len(ids), chunk_tokens, chunk_tokens // 4)
    chunks = [ids[a:b] for a, b in cuts]
    order = rank(model, tokenizer, chunks, question, ranking, cache)
    kept, used = [], 0
    for i in order:
        if used + len(chunks[i]) <= room:
            kept.append(i)
            used += len(chunks[i])
    while True:  # decoded and encoded again, the text may count a few tokens more
        prompt = build(_context(tokenizer, ids, [cuts[i] for i in sorted(kept)]))
        if len(prompt) <= limit:
            return Retrieved(prompt, sorted(kept), len(chunks), order)
        kept.pop()


def _context(tokenizer, ids: Sequence[int], kept: list[tuple[int, int]]) -> str:
    """The kept spans' text: overlapping or touching spans as one run, runs apart marked."""
    runs: list[list[int]] = []
    for start, end in kept:
        if runs and start <= runs[-1][1]:
            runs[-1][1] = end
        else:
            runs.append([start, end])
    return SEPARATOR.join(tokenizer.decode(ids[a:b]) for a, b in runs)
