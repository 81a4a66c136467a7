"""Encoder-decoder generation: the source is encoded once, then the decoder is run from the
model's start token by the same decode core as any decoder-only model (greedy, sampled, beam),
through `EncoderDecoder.decoder_view`. The cross-attention keys and values are projected at the
first step and kept in the KV cache; without the cache (`use_cache=False`) every step runs the
decoder over its whole output again, the baseline the cache must equal.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch

from ..errors import InputError
from ..model.encoder_decoder import EncoderDecoder
from .beam import beam_search
from .config import GenerationConfig, GenerationResult, Piece
from .core import Row, SamplingState, clock, decode_rows, eos_ids, fit_prompt, seeded_generators
from .stopping import Decoder


def encode_source(model: EncoderDecoder, source_ids: Sequence[int],
                  config: GenerationConfig) -> tuple[list[int], torch.Tensor, float]:
    """The source as the encoder sees it (cut to the window when config.truncate), its encoder
    output (1, S, d), and the seconds the encoder took."""
    source = fit_prompt(source_ids, model.config.context_length, config)
    device = model.embed.tokens.weight.device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            start = clock(device)
            memory = model.encode(torch.tensor([source], device=device))  # (1, S, d)
            seconds = clock(device) - start
    finally:
        model.train(was_training)
    return source, memory, seconds


def stream_seq2seq(
    model: EncoderDecoder,
    source_ids: Sequence[int],
    config: GenerationConfig,
    tokenizer: Decoder | None = None,
) -> Generator[Piece, None, list[GenerationResult]]:
    """Decode one source, yielding each new token as a Piece; returns [its GenerationResult],
    whose prompt_ids are the source ids."""
    if config.overflow != "stop":
        raise InputError("overflow", "an encoder-decoder's output stops at the end of its window")
    source, memory, encode_seconds = encode_source(model, source_ids, config)
    view, mc = model.decoder_view(memory), model.config
    prompt = [mc.decoder_start_id]
    device = memory.device
    if config.beams > 1:
        result = beam_search(view, prompt, config, tokenizer)
    else:
        row = Row(prompt, config, mc.context_length, eos_ids(config, tokenizer), tokenizer)
        state = SamplingState(config.sampling, [prompt], mc.vocab_size,
                              seeded_generators(config.seed, 1, device))
        timing = yield from decode_rows(view, [row], config, state)
        result = row.result(*timing)
    result.prompt_ids = source
    result.prefill_seconds += encode_seconds
    return [result]
