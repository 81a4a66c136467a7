"""SmolLM2-135M-Instruct steered per request in the engine: a vector built from positive
minus negative sentiment sentences raises the probability of positive words after neutral
prompts, and lowers that of negative ones: the log-odds log P(good)/P(bad) of the next token
rises at every α tried (large α also moves mass to other tokens, so P(good) alone is not
monotonic). α = 0 is bitwise the unsteered request. Prints the shift per prompt and α."""

from __future__ import annotations

import math

import pytest
import torch

from glassformer import load
from glassformer.interpret.lens import read_out
from glassformer.interpret.steer import build_vector
from glassformer.serving import Engine, EngineConfig, RequestParams

pytestmark = pytest.mark.slow

SITE = "blocks.10.resid_post"
POSITIVE = ["I love this, it is wonderful.", "What a great and happy day!",
            "The movie was excellent and fun.", "She was delighted with the beautiful gift.",
            "This is the best meal I have ever had.", "Everyone was cheerful and kind."]
NEGATIVE = ["I hate this, it is awful.", "What a terrible and sad day!", "The movie was boring and bad.",
            "She was upset with the ugly gift.", "This is the worst meal I have ever had.",
            "Everyone was angry and rude."]
NEUTRAL = ["I think the movie was", "Today I feel", "The food at this restaurant is", "My new job is"]
GOOD = [" good", " great", " wonderful", " happy", " excellent", " amazing", " beautiful", " fun"]
BAD = [" bad", " terrible", " awful", " sad", " boring", " horrible", " ugly", " angry"]
LAST = "blocks.29.resid_post"  # the last residual: read out, the next token's distribution


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load(str(smollm2_path), quantize="none", progress=False)


def _single_tokens(tokenizer, words):
    ids = [tokenizer.encode(word) for word in words]
    return [i[0] for i in ids if len(i) == 1]


def test_steering_raises_the_positive_words_probability(smollm2):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    vector = build_vector(model, SITE, [tokenizer.encode(t) for t in POSITIVE],
                          [tokenizer.encode(t) for t in NEGATIVE], "smollm2-135m-instruct")
    good, bad = _single_tokens(tokenizer, GOOD), _single_tokens(tokenizer, BAD)
    assert len(good) >= 4 and len(bad) >= 4
    alphas = (0.0, 2.0, 4.0, 8.0)
    engine = Engine(model, tokenizer, EngineConfig(kv_memory_mb=32))
    handles = {}
    for prompt in NEUTRAL:  # each prompt plain and at every α, all in the same steps
        ids = tokenizer.encode(prompt)
        handles[prompt, None] = engine.submit(ids, RequestParams(max_new_tokens=1, capture=(LAST,)))
        for alpha in alphas:
            steer = (vector.steer(alpha, "sentiment"),)
            params = RequestParams(max_new_tokens=1, capture=(LAST,), steer=steer)
            handles[prompt, alpha] = engine.submit(ids, params)
    engine.run_until_done()

    def mass(handle):  # P(a positive word), P(a negative word) as the next token
        probs = read_out(model, handle.wait(0).captured[LAST][0, -1]).float().softmax(-1)
        return float(probs[good].sum()), float(probs[bad].sum())

    shift = {alpha: [] for alpha in alphas}  # (Δ P(good), Δ P(bad), Δ log-odds) per prompt
    for prompt in NEUTRAL:
        plain = handles[prompt, None].wait(0).captured[LAST]
        assert torch.equal(handles[prompt, 0.0].wait(0).captured[LAST], plain)  # α = 0: no steer
        base_good, base_bad = mass(handles[prompt, None])
        for alpha in alphas:
            now_good, now_bad = mass(handles[prompt, alpha])
            odds = math.log(now_good / now_bad) - math.log(base_good / base_bad)
            shift[alpha].append((now_good - base_good, now_bad - base_bad, odds))
        steered = [f"a={a:g}: {base_good + shift[a][-1][0]:.4f}, {base_bad + shift[a][-1][1]:.4f}"
                   for a in alphas[1:]]
        print(f"{prompt!r}: P(good) {base_good:.4f}, P(bad) {base_bad:.4f}; steered " + ", ".join(steered))
    mean = {alpha: [sum(column) / len(NEUTRAL) for column in zip(*rows, strict=True)]
            for alpha, rows in shift.items()}
    print(f"{SITE}, {len(POSITIVE)} positive vs {len(NEGATIVE)} negative sentences; mean shift of "
          "P(good), P(bad), log-odds: " +
          ", ".join(f"a={a:g}: {g:+.4f}, {b:+.4f}, {o:+.2f}" for a, (g, b, o) in mean.items()))
    assert mean[2.0][0] > 0 and mean[4.0][0] > 0  # more positive words
    for alpha in alphas[1:]:
        assert mean[alpha][1] < 0 and mean[alpha][2] > 0.5  # fewer negative ones, better odds
