import math
import re

import numpy as np
import pytest
import torch

from glassformer import ModelConfig, Transformer
from glassformer.data import tinyshakespeare
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.generation.retrieval import (
    EMBED_BATCH,
    bm25_scores,
    embedding_scores,
    embeddings,
    interleaved,
    rank,
    retrieve,
    spans,
)

NEEDLE = "The secret number of Verona is 4821."
QUESTION = "What is the secret number of Verona?"
CHUNK = 64  # retrieve's chunks overlap by 16: they start every 48 tokens
AT = 48 * 40 + 16  # where the needle starts: whole in retrieve's chunk 40 and in plain chunk 30 alone


@pytest.fixture(scope="module")
def text():
    return tinyshakespeare().read_text(encoding="utf-8")[:16_000]


@pytest.fixture(scope="module")
def tokenizer(text):
    return HFTokenizer.train_bpe([text, NEEDLE, QUESTION, "0123456789"], 400)


@pytest.fixture(scope="module")
def model(tokenizer):
    """A model whose hidden states are its (normed) token embeddings: every block's matrices are
    zero, so its residual branches add nothing. Its mean-pooled state is a bag of tokens, and the
    needle's chunk, which shares the question's words, is the one closest to the question."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, context_length=512, d_model=256, n_layers=1,
                         n_heads=4, position="rope", norm="rmsnorm", activation="silu", gated=True)
    model = Transformer(config).eval()
    with torch.no_grad():
        for weight in model.blocks.parameters():
            if weight.dim() > 1:
                weight.zero_()
    return model


@pytest.fixture(scope="module")
def document(tokenizer, text):
    """3,840 tokens of Shakespeare with the needle at token AT."""
    hay = tokenizer.encode(text)[: 60 * CHUNK]
    needle = tokenizer.encode(NEEDLE)
    assert len(needle) <= 32 and len(hay) == 60 * CHUNK  # no other chunk holds a token of it
    return hay[:AT] + needle + hay[AT + len(needle):]


def cut(ids, size):
    """Chunks without overlap, as the synthetic document is laid out."""
    return [ids[a:b] for a, b in spans(len(ids), size, 0)]


@pytest.mark.parametrize("n, size, overlap", [(103, 25, 0), (103, 25, 6), (10, 25, 6), (25, 25, 6)])
def test_chunks_cover_the_document_and_overlap_as_told(n, size, overlap):
    cuts = spans(n, size, overlap)
    assert cuts[0][0] == 0 and cuts[-1][1] == n
    assert all(b - a == size for a, b in cuts[:-1]) and 0 < cuts[-1][1] - cuts[-1][0] <= size
    assert all(b1 - a2 == overlap for (_, b1), (a2, _) in zip(cuts, cuts[1:], strict=False))
    for start in range(n - overlap):  # any run of overlap + 1 tokens lies whole in some chunk
        assert any(a <= start and start + overlap + 1 <= b for a, b in cuts)
    with pytest.raises(ValueError, match="^chunk_tokens"):
        spans(n, 0, 0)
    with pytest.raises(ValueError, match="^overlap"):
        spans(n, size, size)


def _bm25_reference(chunks: list[str], question: str, stopwords: set[str]) -> np.ndarray:
    """BM25 (Lucene variant) as the module's docstring writes it, in plain Python."""
    def words(text):
        return [w for w in re.findall(r"(?u)\b\w\w+\b", text.lower()) if w not in stopwords]

    docs = [words(c) for c in chunks]
    avgdl, n = sum(map(len, docs)) / len(docs), len(docs)
    scores = np.zeros(n)
    for t in words(question):
        n_t = sum(t in d for d in docs)
        if n_t == 0:
            continue
        idf = math.log(1 + (n - n_t + 0.5) / (n_t + 0.5))
        for i, d in enumerate(docs):
            f = d.count(t)
            scores[i] += idf * f / (f + 1.5 * (1 - 0.75 + 0.75 * len(d) / avgdl))
    return scores


def test_bm25_matches_the_formula_and_ranks_the_needle_first(tokenizer, document):
    from bm25s.stopwords import STOPWORDS_EN

    chunks = [tokenizer.decode(c) for c in cut(document, CHUNK)]
    scores = bm25_scores(chunks, QUESTION)
    np.testing.assert_allclose(scores, _bm25_reference(chunks, QUESTION, set(STOPWORDS_EN)),
                               rtol=1e-5)
    assert int(np.argmax(scores)) == 30


def test_embedding_is_the_cosine_of_mean_pooled_hidden_states(model, tokenizer, document):
    chunks = cut(document, CHUNK)
    scores = embedding_scores(model, chunks, tokenizer.encode(QUESTION))
    with torch.no_grad():
        q = model.forward_hidden(torch.tensor([tokenizer.encode(QUESTION)]))[0].mean(0)
        c = model.forward_hidden(torch.tensor([chunks[7]]))[0].mean(0)
    assert scores[7] == pytest.approx(float(q @ c / (q.norm() * c.norm())), rel=1e-5)
    assert rank(model, tokenizer, chunks, QUESTION, "embedding")[0] == 30


def test_batched_embeddings_match_each_chunk_read_alone_and_the_cache_skips_the_model(tokenizer, document):
    """A random model (attention at work): chunks of two lengths, more than one batch of each."""
    torch.manual_seed(1)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, context_length=128, d_model=32, n_layers=2,
                         n_heads=4, position="rope", norm="rmsnorm", activation="silu", gated=True)
    model = Transformer(config).eval()
    chunks = cut(document[: 20 * EMBED_BATCH + 7], 20)  # 16 + 1 of 20 tokens, the last of 7
    chunks.append(chunks[3])  # a repeat is read once
    with torch.no_grad():
        alone = torch.stack([model.forward_hidden(torch.tensor([c]))[0].mean(0) for c in chunks])
    cache = {}
    torch.testing.assert_close(embeddings(model, chunks, cache), alone, rtol=1e-4, atol=1e-5)
    assert len(cache) == len(chunks) - 1

    def unused(*args, **kwargs):
        raise AssertionError("a cached chunk was read again")

    model.forward_hidden = unused
    torch.testing.assert_close(embeddings(model, chunks[::-1], cache), alone.flip(0), rtol=0, atol=0)


def test_the_cache_keeps_the_ranking_across_questions_over_the_same_document(model, tokenizer, document):
    chunks, cache = cut(document, CHUNK), {}
    for question in (QUESTION, "Who is the king of Verona?", QUESTION):
        assert rank(model, tokenizer, chunks, question, "both", cache) == \
            rank(model, tokenizer, chunks, question, "both")
    assert len(cache) == len({tuple(c) for c in chunks})


def test_interleaving_takes_each_orders_next_item_in_turn():
    assert interleaved([2, 0, 1, 3], [3, 2, 1, 0]) == [2, 3, 0, 1]
    assert interleaved([1, 0, 2]) == [1, 0, 2]


def test_both_keeps_bm25s_first_chunk_whatever_the_embedding_makes_of_it(model, tokenizer, document,
                                                                         monkeypatch):
    from glassformer.generation import retrieval

    question = tokenizer.encode(f"\n\n{QUESTION}")

    def build(context: str) -> list[int]:
        return tokenizer.encode(context) + question

    def against_bm25(model, chunks, question_ids, cache=None):  # the embedding ranks BM25's best last
        return -bm25_scores([tokenizer.decode(c) for c in chunks], QUESTION)

    monkeypatch.setattr(retrieval, "embedding_scores", against_bm25)
    limit = 3 * CHUNK + len(question)
    got = retrieve(model, tokenizer, tokenizer.decode(document), QUESTION, build, limit, CHUNK, "both")
    assert 40 in got.chunks and len(got.ids) <= limit and NEEDLE in tokenizer.decode(got.ids)
    ids = tokenizer.encode(tokenizer.decode(document))
    chunks = [ids[a:b] for a, b in spans(len(ids), CHUNK, CHUNK // 4)]
    embedding_first = int(np.argmax(against_bm25(model, chunks, None)))
    assert got.order[:2] == [40, embedding_first]


@pytest.mark.parametrize("ranking", ["bm25", "embedding", "both"])
def test_prompt_fits_the_window_with_the_needle_and_chunks_in_order(model, tokenizer, document, ranking):
    text = tokenizer.decode(document)
    question = tokenizer.encode(f"\n\n{QUESTION}")

    def build(context: str) -> list[int]:
        return tokenizer.encode(context) + question

    got = retrieve(model, tokenizer, text, QUESTION, build, 400, CHUNK, ranking)
    assert len(got.ids) <= 400 and got.ids[-len(question):] == question
    assert got.order[0] == 40 and 40 in got.chunks
    assert got.chunks == sorted(got.chunks) and len(got.chunks) >= 5
    assert NEEDLE in tokenizer.decode(got.ids)
    assert got.n_chunks == len(spans(len(tokenizer.encode(text)), CHUNK, CHUNK // 4))


def test_a_budget_of_one_chunk_holds_the_best_chunk_alone(model, tokenizer, document):
    question = tokenizer.encode(f"\n\n{QUESTION}")
    limit = CHUNK + len(question) + 8  # room for one chunk, not two

    def build(context: str) -> list[int]:
        return tokenizer.encode(context) + question

    got = retrieve(model, tokenizer, tokenizer.decode(document), QUESTION, build, limit, CHUNK, "bm25")
    assert got.chunks == [got.order[0]] == [40] and len(got.ids) <= limit
    assert NEEDLE in tokenizer.decode(got.ids)


def test_bad_input_is_one_line_naming_the_field(model, tokenizer):
    def build(context):
        return tokenizer.encode(context + QUESTION)

    with pytest.raises(ValueError, match="^document: empty"):
        retrieve(model, tokenizer, "  ", QUESTION, build, 100)
    with pytest.raises(ValueError, match="^ranking: choose one of bm25, embedding, both"):
        retrieve(model, tokenizer, "some text here", QUESTION, build, 100, 16, ranking="dense")
    with pytest.raises(ValueError, match="^limit: 3 tokens leave no room"):
        retrieve(model, tokenizer, "some text here", QUESTION, build, 3)
    with pytest.raises(ValueError, match="^chunk_tokens: 256 exceed the"):
        retrieve(model, tokenizer, "some text here", QUESTION, build, 100, chunk_tokens=256)
