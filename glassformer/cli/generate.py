"""`glassformer generate`: continue a prompt, streaming the text as it is made."""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time

from ..accel.quantize import quantize_format, quantize_model
from ..errors import InputError
from ..formats.files import read_text
from ..formats.sources import ANNOUNCED_PARAMETERS
from ..generation.config import Steer
from ..generation.context_extension import extend_context
from ..generation.generate import GenerationConfig, generate, stream
from ..generation.retrieval import RANKINGS, retrieve
from ..interpret.steer import SteeringVector, steered
from ..language_model import LanguageModel, load
from ..serving import RequestParams
from ..training.lora import apply_adapter, merge_lora
from .options import (
    CONTEXT,
    ENGINE,
    SAMPLING,
    add,
    add_computing,
    add_prompt,
    engine_config,
    finite,
    inference_precision,
    or_default,
    positive_int,
    read_prompt,
    sampling_config,
    settle_threads,
    sink_policy,
)
from .waits import announce, announce_compile, announce_engine

MAX_NEW_TOKENS, ROPE_FACTOR = 64, 2.0
# A --prompts-file line may use OpenAI's names for the request's settings.
OPENAI_NAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="continue a prompt with a model")
    add_prompt(parser, "the text to continue")
    parser.add_argument("--prompts-file", metavar="F.jsonl",
                        help="many prompts at once through the serving engine: one JSON object per "
                             'line, {"prompt": ..., and any sampling field, by our name or OpenAI\'s '
                             '(max_tokens, stop, seed, temperature, top_p, ...)}; prints a JSON line each')
    engine = parser.add_argument_group("the serving engine (--prompts-file)")
    add(engine, *(name for name in ENGINE if name != "--kv-dtype"))
    add(parser, "--kv-dtype")
    add(parser, "--model", required=True)
    add(parser, "--quantize", "--compile", "--deterministic", "--max-new-tokens", *SAMPLING)
    parser.add_argument("--beams", type=positive_int, default=1, help="beam search width (1: no beam search)")
    parser.add_argument("--length-penalty", type=finite, default=1.0, help="beam score exponent")
    add(parser, "--seed")
    parser.add_argument("--stop", nargs="+", action="extend", default=[], metavar="STR",
                        help="stop when the text contains any of these strings (\\n, \\t understood)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-text")
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole prefix every step")
    parser.add_argument("--truncate", action="store_true", help="cut a too-long prompt from the left")
    parser.add_argument("--slide", action="store_true",
                        help="past the context window, drop the oldest tokens instead of stopping")
    add(parser, "--rope-scaling", "--rope-factor", "--lora", *CONTEXT)
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the model's chat template")
    add(parser, "--json", "--steer")
    context = parser.add_argument_group("a document longer than the window (--context retrieve)")
    context.add_argument("--question", help="retrieve: the question asked after the chunks")
    context.add_argument("--ranking", choices=RANKINGS, default="both",
                         help="retrieve: rank chunks by BM25, by the model's mean-pooled hidden "
                              "states, or both interleaved (default both)")
    context.add_argument("--chunk-tokens", type=positive_int, default=256,
                         help="retrieve: tokens per chunk (default 256)")
    add_computing(parser)
    parser.set_defaults(run=run)


def _steers(specs: list[str]) -> list[Steer]:
    """PATH[:ALPHA] each (ALPHA 1 when not given)."""
    steers = []
    for spec in specs:
        path, sep, alpha = spec.rpartition(":")
        if not sep:
            path, alpha = spec, "1"
        try:
            value = finite(alpha)
        except argparse.ArgumentTypeError as error:
            raise InputError("--steer", f"{spec!r}: ALPHA {error}") from None
        steers.append(SteeringVector.load(path).steer(value, path))
    return steers


def _prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return tokenizer.encode(prompt)
    if not hasattr(tokenizer, "apply_chat_template"):
        raise InputError("--chat", "this model's tokenizer has no chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])


def _retrieved_ids(args: argparse.Namespace, model, tokenizer, document: str, limit: int) -> list[int]:
    """The document's chunks that best match --question and fit in `limit` tokens, then the question."""
    question = args.question

    def build(context: str) -> list[int]:
        return _prompt_ids(tokenizer, f"{context}\n\n{question}" if context else question, args.chat)

    return retrieve(model, tokenizer, document, question, build, limit, args.chunk_tokens,
                    args.ranking).ids


def run(args: argparse.Namespace) -> int:
    if args.prompts_file is not None and (args.prompt is not None or args.prompt_file is not None):
        raise InputError(None, "give a prompt or --prompts-file, not both")
    if (args.context == "retrieve") != (args.question is not None):
        raise InputError("--question", "give it with --context retrieve, and only then")
    if args.context == "retrieve" and args.prompts_file is not None:
        raise InputError(None, "--context retrieve: one document at a time, not with --prompts-file")
    prompt = None if args.prompts_file is not None else read_prompt(args)
    config = GenerationConfig(
        max_new_tokens=or_default(args.max_new_tokens, MAX_NEW_TOKENS),
        sampling=sampling_config(args),
        seed=args.seed,
        stop=tuple(s.replace("\\n", "\n").replace("\\t", "\t") for s in args.stop),
        eos_ids=() if args.ignore_eos else None,
        use_cache=not args.no_cache,
        beams=args.beams,
        length_penalty=args.length_penalty,
        truncate=args.truncate,
        overflow="slide" if args.slide else "stop",
        kv_dtype=args.kv_dtype,
        sink=sink_policy(args, retrieve=True),
        compile=args.compile,
    )
    extend = args.rope_scaling not in (None, "none")  # a new window first, then the weights converted
    device, precision = inference_precision(args)
    quantize = precision.quantize
    if args.lora is not None and len(args.lora) > 1:
        raise InputError("--lora", "generate applies one adapter (serve serves several)")
    convert = extend or args.lora is not None  # plain weights first, converted at the end
    started = time.perf_counter()
    language_model = load(args.model, quantize=None if convert else quantize, announce=announce)
    args.load_seconds = round(time.perf_counter() - started, 3)
    settle_threads(args)
    model, tokenizer = language_model.model, language_model.tokenizer
    if not model.config.causal:
        raise InputError(args.model, "an encoder (bidirectional attention) does not continue "
                         "text; try glassformer fill-mask")
    if args.lora is not None:  # folded into the weights: the merged model, at its speed
        apply_adapter(model, args.lora[0][1], base=args.model)
        merge_lora(model)
    if extend:
        model = extend_context(model, args.rope_scaling, or_default(args.rope_factor, ROPE_FACTOR))
    if convert and quantize is not None:
        if sum(p.numel() for p in model.parameters()) >= ANNOUNCED_PARAMETERS:
            announce(f"converting the weights ({quantize}) for the fused decode step")
        quantize_model(model, quantize_format(quantize))
    model = precision.place(model, device)
    with steered(model, _steers(args.steer or [])):  # every token of every prompt (the module path)
        return _generate(args, model, tokenizer, prompt, config)


def _generate(args: argparse.Namespace, model, tokenizer, prompt: str | None,
              config: GenerationConfig) -> int:
    if args.prompts_file is not None:
        return _run_many(args, LanguageModel(model, tokenizer), config)
    announce_compile(config.compile)
    if args.context == "retrieve":
        prompt_ids = _retrieved_ids(args, model, tokenizer, prompt,
                                    model.config.context_length - config.max_new_tokens)
    else:
        prompt_ids = _prompt_ids(tokenizer, prompt, args.chat)
    if args.json or config.beams > 1:
        result = generate(model, prompt_ids, config, tokenizer)
        if not args.json:
            print(result.text)
    else:
        run_ = stream(model, prompt_ids, config, tokenizer)
        for piece in run_:
            print(piece.text, end="", flush=True)
        print(flush=True)
        result = run_.result
    if args.json:
        print(json.dumps(result.to_dict() | {"load_seconds": args.load_seconds}))
    else:
        print(
            f"[{result.n_generated} tokens, stop: {result.stop_reason}, "
            f"prefill {result.prefill_tokens_per_second:.1f} tok/s, "
            f"decode {result.decode_tokens_per_second:.1f} tok/s, load {args.load_seconds:.1f} s]",
            file=sys.stderr,
        )
        if result.stop_reason == "context_full":
            print(f"glassformer: reached the end of the {model.config.context_length}-token context window "
                  "(--slide drops the oldest tokens and goes on)", file=sys.stderr)
    return 0


def _read_requests(args: argparse.Namespace, language_model: LanguageModel, config: GenerationConfig):
    """Prompt ids, RequestParams and the line number of each line: the line's fields over the
    command's flags; ids outside the vocabulary are refused with the line's number."""
    defaults = dataclasses.asdict(config.sampling) | {
        "max_new_tokens": config.max_new_tokens, "seed": config.seed, "stop": config.stop,
        "eos_ids": config.eos_ids,
    }
    prompts, params, lines = [], [], []
    for number, line in enumerate(read_text(args.prompts_file).splitlines(), 1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
            prompt = fields.pop("prompt")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise InputError(None, f"{args.prompts_file}:{number}: expected a JSON object with a prompt"
                             ) from None
        try:
            params.append(RequestParams.from_fields(**(defaults | _own_names(fields))))
            prompts.append(_prompt_ids(language_model.tokenizer, prompt, args.chat)
                           if isinstance(prompt, str) else language_model.encode(prompt))
            _check_window(fields, len(prompts[-1]), language_model.model.config.context_length)
            lines.append(number)
        except (ValueError, TypeError) as error:
            raise InputError(None, f"{args.prompts_file}:{number}: {error}") from None
    if not prompts:
        raise InputError(args.prompts_file, "no prompts")
    return prompts, params, lines


def _check_window(fields: dict, n_prompt: int, window: int) -> None:
    """A line that asks for more new tokens than the window leaves after its prompt is refused
    by the name it used (a flag's default is cut at the window, as for one prompt)."""
    for name, value in fields.items():
        if OPENAI_NAMES.get(name, name) == "max_new_tokens" and n_prompt + value > window:
            raise InputError(name, f"{value} new tokens after the prompt's {n_prompt} pass the "
                             f"model's {window}-token window: give at most {max(window - n_prompt, 0)}")


def _own_names(fields: dict) -> dict:
    """A line's settings with OpenAI's names (max_tokens) replaced by ours (max_new_tokens)."""
    own = {}
    for name, value in fields.items():
        ours = OPENAI_NAMES.get(name, name)
        if ours in own:
            raise InputError(name, f"gives {ours} again; give one of them")
        own[ours] = value
    return own


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _run_many(args: argparse.Namespace, language_model: LanguageModel, config: GenerationConfig) -> int:
    if args.beams > 1 or args.no_cache or args.slide or args.truncate:
        raise InputError("--prompts-file", "--beams, --no-cache, --slide and --truncate need one prompt")
    prompts, params, lines = _read_requests(args, language_model, config)
    device = str(language_model.model.embed.tokens.weight.device)
    engine = engine_config(args, device)
    announce_engine(engine, device)
    start, done = time.perf_counter(), [0, 0]

    def progress(index, result):
        done[0], done[1] = done[0] + 1, done[1] + result.n_generated
        rate = done[1] / (time.perf_counter() - start)
        print(f"\r[{done[0]}/{len(prompts)} requests, {rate:.1f} tok/s]", end="", file=sys.stderr, flush=True)

    results = language_model.generate_many(prompts, params=params, engine=engine, on_result=progress,
                                           labels=[f"{args.prompts_file}:{n}" for n in lines])
    wall = time.perf_counter() - start
    print(file=sys.stderr)
    for result in results:
        print(json.dumps(result.to_dict()))
    ttft = [r.prefill_seconds for r in results]
    print(json.dumps({
        "requests": len(results),
        "total_tokens_per_second": sum(r.n_generated for r in results) / wall,
        "ttft_p50": _percentile(ttft, 0.5),
        "ttft_p95": _percentile(ttft, 0.95),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }))
    return 0
