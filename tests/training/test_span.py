"""T5 span corruption: the statistics of the noise masks and the input / target construction,
against a plain reference written with Python lists."""

from __future__ import annotations

import pytest
import torch

from glassformer.formats.tokenizers import CharTokenizer, HFTokenizer
from glassformer.training.span import (
    corrupt,
    noise_mask,
    random_segmentation,
    sentinel_ids,
    span_counts,
    with_sentinels,
)


def runs(mask: list[bool]) -> list[tuple[bool, int]]:
    """(flag, length) of each maximal run, in order."""
    out: list[tuple[bool, int]] = []
    for flag in mask:
        if out and out[-1][0] == flag:
            out[-1] = (flag, out[-1][1] + 1)
        else:
            out.append((flag, 1))
    return out


def reference_corrupt(tokens: list[int], mask: list[bool], sentinels: list[int], eos: int,
                      start: int) -> tuple[list[int], list[int], list[int]]:
    inputs, targets, i, span = [], [], 0, 0
    for flag, n in runs(mask):
        piece = tokens[i : i + n]
        if flag:
            inputs.append(sentinels[span])
            targets += piece
            span += 1
        else:
            inputs += piece
            targets.append(sentinels[span])
        i += n
    inputs.append(eos)
    targets.append(eos)
    return inputs, [start] + targets[:-1], targets


@pytest.mark.parametrize("length, expected", [(2, (1, 1)), (20, (3, 1)), (64, (10, 3)),
                                               (512, (77, 26))])
def test_span_counts_follow_density_and_mean_length(length, expected):
    assert span_counts(length) == expected


@pytest.mark.parametrize("length", [2, 7, 20, 64, 100])
def test_every_mask_has_the_exact_counts_and_alternates(length):
    g = torch.Generator().manual_seed(length)
    n_noise, n_spans = span_counts(length)
    for _ in range(50):
        mask = noise_mask(length, g).tolist()
        assert len(mask) == length and sum(mask) == n_noise
        pieces = runs(mask)
        assert [flag for flag, _ in pieces] == [False, True] * n_spans  # kept first, noise last


def test_noise_spans_average_three_tokens_and_land_everywhere():
    g = torch.Generator().manual_seed(0)
    masks = torch.stack([noise_mask(300, g) for _ in range(400)])  # (400, 300)
    lengths = [n for m in masks.tolist() for flag, n in runs(m) if flag]
    assert abs(sum(lengths) / len(lengths) - 3.0) < 0.01  # 45 tokens in 15 spans: exactly 3
    assert max(lengths) > 6 and min(lengths) == 1  # lengths vary
    density = masks.float().mean(0)  # (300,) every position but the first is sometimes noise
    assert masks.float().mean().item() == pytest.approx(0.15)
    assert density[0] == 0 and (density[1:] > 0).all()


def test_random_segmentation_is_uniform_over_splits():
    g = torch.Generator().manual_seed(1)
    seen: dict[tuple[int, ...], int] = {}
    for _ in range(3000):
        parts = tuple(random_segmentation(5, 3, g).tolist())
        assert sum(parts) == 5 and min(parts) >= 1
        seen[parts] = seen.get(parts, 0) + 1
    assert len(seen) == 6  # C(4, 2) compositions of 5 into 3 positive parts
    assert all(abs(n / 3000 - 1 / 6) < 0.03 for n in seen.values())


def test_corrupt_equals_the_reference():
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 50, (6, 40), generator=g)
    masks = torch.stack([noise_mask(40, g) for _ in range(6)])
    sentinels = torch.tensor([99, 98, 97, 96, 95])
    inputs, decoder_inputs, targets = corrupt(tokens, masks, sentinels, eos_id=60, start_id=61)
    for b in range(6):
        expected = reference_corrupt(tokens[b].tolist(), masks[b].tolist(), sentinels.tolist(), 60, 61)
        assert (inputs[b].tolist(), decoder_inputs[b].tolist(), targets[b].tolist()) == expected


def test_the_example_sentence():
    words = "Thank you for inviting me to your party last week .".split()
    mask = torch.tensor([[w in ("for", "inviting", "last") for w in words]])
    tokens = torch.arange(len(words))[None]
    inputs, _, targets = corrupt(tokens, mask, torch.tensor([100, 101, 102]), eos_id=-1, start_id=-2)
    names = {100: "<X>", 101: "<Y>", 102: "<Z>", -1: "</s>"}
    show = lambda ids: [words[i] if 0 <= i < len(words) else names[i] for i in ids]  # noqa: E731
    assert show(inputs[0].tolist()) == "Thank you <X> me to your party <Y> week . </s>".split()
    assert show(targets[0].tolist()) == "<X> for inviting <Y> last <Z> </s>".split()


def test_char_sentinels_are_private_use_characters_that_round_trip(tmp_path):
    tokenizer = with_sentinels(CharTokenizer.train(["hello world"]), 3)
    ids = sentinel_ids(tokenizer, 3)
    assert tokenizer.decode(ids.tolist()) == "\ue000\ue001\ue002"
    assert tokenizer.encode("hello") == CharTokenizer.train(["hello world"]).encode("hello")
    tokenizer.save(tmp_path / "tokenizer.json")
    assert sentinel_ids(CharTokenizer.load(tmp_path / "tokenizer.json"), 3).tolist() == ids.tolist()
    with pytest.raises(ValueError, match="lacks the 4 sentinel tokens"):
        sentinel_ids(tokenizer, 4)


def test_bpe_sentinels_are_special_tokens():
    tokenizer = with_sentinels(HFTokenizer.train_bpe(["the quick brown fox"] * 20, 300), 2)
    ids = sentinel_ids(tokenizer, 2).tolist()
    assert tokenizer.decode(ids) == "<extra_id_0><extra_id_1>"
    assert ids[0] != ids[1] and max(ids) < tokenizer.vocab_size
