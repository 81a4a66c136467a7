"""Continue prompts: `generate` one, `generate_batch` several in one left-padded batch,
`stream` one token by token. Each builds its rows and sampling state and runs the decode core
(core.py); `beams > 1` hands the prompt to beam search (beam.py) instead. An encoder-decoder
(config.n_encoder_layers > 0) takes each prompt as its source (seq2seq.py), one at a time.
`config.compile` asks for the compiled one-token step (compiled.py), checked against the model
before anything runs.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence

from ..errors import InputError
from ..model.transformer import Transformer
from .beam import beam_search
from .compiled import check_compilable
from .config import GenerationConfig, GenerationResult, Piece
from .core import Row, SamplingState, decode_rows, eos_ids, seeded_generators
from .seq2seq import stream_seq2seq
from .stopping import Decoder

DEFAULT = GenerationConfig()  # greedy, with the KV cache


def stream_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig = DEFAULT,
    tokenizer: Decoder | None = None,
) -> Generator[Piece, None, list[GenerationResult]]:
    """Generate for every prompt at once, yielding each new token as a Piece; the generator's
    return value is the list of GenerationResult, one per prompt."""
    mc, device = model.config, model.embed.tokens.weight.device
    eos = eos_ids(config, tokenizer)
    rows = [Row(p, config, mc.context_length, eos, tokenizer) for p in prompts]
    generators = seeded_generators(config.seed, len(rows), device)
    state = SamplingState(config.sampling, [r.prompt for r in rows], mc.vocab_size, generators)
    timing = yield from decode_rows(model, rows, config, state)
    return [row.result(*timing) for row in rows]


class Stream:
    """The Pieces of one prompt's generation as they come; `result` once iteration ends."""

    def __init__(self, steps: Generator[Piece, None, list[GenerationResult]]) -> None:
        self._steps = steps
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Piece]:
        results = yield from self._steps
        self.result = results[0]


def _drain(steps: Generator[Piece, None, list[GenerationResult]]) -> list[GenerationResult]:
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def stream(
    model: Transformer,
    prompt_ids: Sequence[int],
    config: GenerationConfig = DEFAULT,
    tokenizer: Decoder | None = None,
) -> Stream:
    """Iterate over the Pieces of one prompt's continuation as each token is generated."""
    if config.beams > 1:
        raise InputError("beams", "beam search settles its output only at the end; it cannot stream")
    if config.compile:
        check_compilable(model)
    if model.config.n_encoder_layers:
        return Stream(stream_seq2seq(model, prompt_ids, config, tokenizer))
    return Stream(stream_batch(model, [prompt_ids], config, tokenizer))


def generate_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig = DEFAULT,
    tokenizer: Decoder | None = None,
) -> list[GenerationResult]:
    """Continue several prompts in one left-padded batch; each row as if generated alone (with
    a seed, a sampled row draws what its prompt alone would)."""
    if config.compile:
        check_compilable(model)
    if model.config.n_encoder_layers:
        return [generate(model, p, config, tokenizer) for p in prompts]
    if config.beams > 1:
        return [beam_search(model, p, config, tokenizer) for p in prompts]
    return _drain(stream_batch(model, prompts, config, tokenizer))


def generate(
    model: Transformer,
    prompt_ids: Sequence[int],
    config: GenerationConfig = DEFAULT,
    tokenizer: Decoder | None = None,
) -> GenerationResult:
    """Continue one prompt: greedy, sampled, or beam search when config.beams > 1."""
    if config.compile:
        check_compilable(model)
    if model.config.n_encoder_layers:
        return _drain(stream_seq2seq(model, prompt_ids, config, tokenizer))[0]
    if config.beams > 1:
        return beam_search(model, prompt_ids, config, tokenizer)
    return _drain(stream_batch(model, [prompt_ids], config, tokenizer))[0]
