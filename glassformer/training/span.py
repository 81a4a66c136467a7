"""T5's span corruption (Raffel et al., 2020, §3.1.4): an encoder-decoder learns to fill gaps.

In a window of L tokens, round(0.15 L) noise tokens are split into round(noise / 3) spans (mean
span length 3) placed at random; the kept text is split into as many spans, and the two
alternate, kept first. Each noise span becomes one sentinel in the input; the target is the
sentinels, each followed by the tokens it hid, and end-of-text:

    window   Thank you for inviting me to your party last week .
    input    Thank you <X> me to your party <Y> week . </s>
    target   <X> for inviting <Y> last <Z> </s>      (noise_mask's windows end in noise: no <Z>)

Sentinel i is its own token. A character-level vocabulary gets them as the private-use
characters U+E000, U+E001, … (they decode as themselves and round-trip through tokenizer.json);
a BPE vocabulary gets the special tokens <extra_id_0>, <extra_id_1>, … as in T5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tokenizers import AddedToken

from ..errors import InputError
from ..formats.tokenizers import CharTokenizer, HFTokenizer

NOISE_DENSITY = 0.15
MEAN_SPAN_LENGTH = 3.0
CHAR_SENTINEL = 0xE000  # the first private-use code point


def span_counts(length: int, density: float = NOISE_DENSITY,
                mean_span: float = MEAN_SPAN_LENGTH) -> tuple[int, int]:
    """(noise tokens, noise spans) in a window of `length` tokens (at least 2)."""
    if length < 2:
        raise InputError("context_length", f"span corruption needs windows of 2 or more tokens, got {length}")
    n_noise = min(max(round(length * density), 1), length - 1)
    return n_noise, max(round(n_noise / mean_span), 1)


def random_segmentation(n_items: int, n_segments: int, generator: torch.Generator) -> torch.Tensor:
    """n_items split into n_segments positive lengths (n_segments,), every split equally likely:
    the segments start at n_segments - 1 distinct cut points drawn among n_items - 1."""
    cuts = torch.randperm(n_items - 1, generator=generator)[: n_segments - 1].sort().values + 1
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([n_items])])
    return bounds.diff()  # (n_segments,)


def noise_mask(length: int, generator: torch.Generator, density: float = NOISE_DENSITY,
               mean_span: float = MEAN_SPAN_LENGTH) -> torch.Tensor:
    """Which of `length` tokens are noise (length,) bool: kept and noise spans alternate,
    kept first."""
    n_noise, n_spans = span_counts(length, density, mean_span)
    noise = random_segmentation(n_noise, n_spans, generator)  # (n_spans,)
    kept = random_segmentation(length - n_noise, n_spans, generator)  # (n_spans,)
    lengths = torch.stack([kept, noise], dim=1).flatten()  # (2 n_spans,) kept, noise, kept, …
    return torch.tensor([False, True]).repeat(n_spans).repeat_interleave(lengths)  # (length,)


def replace_spans(tokens: torch.Tensor, mask: torch.Tensor, sentinels: torch.Tensor) -> torch.Tensor:
    """tokens (B, L) with each run of True in mask (B, L) replaced by the next sentinel id; every
    row must have as many runs and masked tokens (as noise_mask gives): (B, L')."""
    starts = mask & ~F.pad(mask[:, :-1], (1, 0), value=False)  # (B, L) first token of each run
    index = (starts.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, L) which run a token is in
    out = torch.where(starts, sentinels.to(tokens.device)[index], tokens)
    return out[~mask | starts].view(tokens.shape[0], -1)  # (B, L')


def corrupt(tokens: torch.Tensor, masks: torch.Tensor, sentinels: torch.Tensor, eos_id: int,
            start_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Windows (B, L) and their noise masks (B, L) -> encoder inputs (B, S), decoder inputs and
    targets (B, U): the targets shifted right behind the decoder's start token."""
    eos = torch.full((tokens.shape[0], 1), eos_id, dtype=tokens.dtype, device=tokens.device)
    inputs = torch.cat([replace_spans(tokens, masks, sentinels), eos], dim=1)  # (B, S)
    targets = torch.cat([replace_spans(tokens, ~masks, sentinels), eos], dim=1)  # (B, U)
    decoder_inputs = torch.cat([torch.full_like(eos, start_id), targets[:, :-1]], dim=1)  # (B, U)
    return inputs, decoder_inputs, targets


def with_sentinels(tokenizer, n: int):
    """The tokenizer with n sentinel tokens added (itself when it has them already)."""
    if isinstance(tokenizer, CharTokenizer):
        extra = "".join(chr(CHAR_SENTINEL + i) for i in range(n))
        return CharTokenizer("".join(sorted(set(tokenizer.chars) | set(extra))), tokenizer.eos_token)
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.tokenizer.add_special_tokens([AddedToken(f"<extra_id_{i}>", special=True)
                                                for i in range(n)])
        return tokenizer
    raise InputError("objective", f"span corruption has no sentinels for a {type(tokenizer).__name__}")


def sentinel_ids(tokenizer, n: int) -> torch.Tensor:
    """The ids of sentinels 0..n-1 (n,); ValueError when the tokenizer lacks them."""
    if isinstance(tokenizer, CharTokenizer):
        texts = [chr(CHAR_SENTINEL + i) for i in range(n)]
    else:
        texts = [f"<extra_id_{i}>" for i in range(n)]
    try:
        ids = [tokenizer.encode(t) for t in texts]
    except (KeyError, ValueError):
        ids = []
    if len(ids) != n or any(len(i) != 1 for i in ids):
        raise InputError("objective", f"the tokenizer lacks the {n} sentinel tokens span corruption needs")
    return torch.tensor([i[0] for i in ids])  # (n,)
