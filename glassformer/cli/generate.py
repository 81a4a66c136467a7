"""`glassformer generate`: continue a prompt, streaming the text as it is made."""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time

from ..accel.quantize import quantize_format, quantize_model
from ..generation.context_extension import extend_context
from ..generation.generate import GenerationConfig, generate, stream
from ..language_model import LanguageModel, load
from ..serving import EngineConfig, RequestParams
from ..serving.kv_pool import KV_DTYPES
from .options import (
    add_prompt,
    add_quantize,
    add_sampling,
    add_threads,
    device,
    finite,
    positive,
    positive_int,
    read_prompt,
    sampling_config,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="continue a prompt with a model")
    add_prompt(parser, "the text to continue")
    parser.add_argument("--prompts-file", metavar="F.jsonl",
                        help="many prompts at once through the serving engine: one JSON object per "
                             'line, {"prompt": ..., and any sampling field}; prints a JSON line each')
    parser.add_argument("--kv-memory-mb", type=positive, default=256.0,
                        help="--prompts-file: KV cache size")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="fp32", help="--prompts-file: KV storage")
    parser.add_argument("--max-batch", type=positive_int, default=16,
                        help="--prompts-file: most requests per step")
    parser.add_argument("--model", required=True, help="checkpoint/HF folder, .gguf file or known name")
    add_quantize(parser)
    parser.add_argument("-n", "--max-new-tokens", type=positive_int, default=64,
                        help="at most this many new tokens")
    add_sampling(parser)
    parser.add_argument("--beams", type=positive_int, default=1, help="beam search width (1: no beam search)")
    parser.add_argument("--length-penalty", type=finite, default=1.0, help="beam score exponent")
    parser.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    parser.add_argument("--stop", nargs="+", action="extend", default=[], metavar="STR",
                        help="stop when the text contains any of these strings (\\n, \\t understood)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-text")
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole prefix every step")
    parser.add_argument("--truncate", action="store_true", help="cut a too-long prompt from the left")
    parser.add_argument("--slide", action="store_true",
                        help="past the context window, drop the oldest tokens instead of stopping")
    parser.add_argument("--rope-scaling", choices=("linear", "ntk", "yarn"), default=None,
                        help="extend a RoPE model's window by --rope-factor")
    parser.add_argument("--rope-factor", type=finite, default=2.0)
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the model's chat template")
    parser.add_argument("--device", type=device, default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    add_threads(parser)
    parser.set_defaults(run=run)


def _prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return tokenizer.encode(prompt)
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError("--chat: this model's tokenizer has no chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])


def run(args: argparse.Namespace) -> int:
    if args.prompts_file is not None and (args.prompt is not None or args.prompt_file is not None):
        raise ValueError("give a prompt or --prompts-file, not both")
    prompt = None if args.prompts_file is not None else read_prompt(args)
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=sampling_config(args),
        seed=args.seed,
        stop=tuple(s.replace("\\n", "\n").replace("\\t", "\t") for s in args.stop),
        eos_ids=() if args.ignore_eos else None,
        use_cache=not args.no_cache,
        beams=args.beams,
        length_penalty=args.length_penalty,
        truncate=args.truncate,
        overflow="slide" if args.slide else "stop",
    )
    extend = args.rope_scaling is not None  # a new window first, then the weights converted
    language_model = load(args.model, quantize=None if extend else args.quantize)
    model, tokenizer = language_model.model, language_model.tokenizer
    if not model.config.causal:
        raise ValueError(f"{args.model}: an encoder (bidirectional attention) does not continue "
                         "text; try glassformer fill-mask")
    if extend:
        model = extend_context(model, args.rope_scaling, args.rope_factor)
        quantize_model(model, quantize_format(args.quantize))
    model = model.to(args.device)
    if args.prompts_file is not None:
        return _run_many(args, LanguageModel(model, tokenizer), config)
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
        print(json.dumps(result.to_dict()))
    else:
        print(
            f"[{result.n_generated} tokens, stop: {result.stop_reason}, "
            f"prefill {result.prefill_tokens_per_second:.1f} tok/s, "
            f"decode {result.decode_tokens_per_second:.1f} tok/s]",
            file=sys.stderr,
        )
        if result.stop_reason == "context_full":
            print(f"glassformer: reached the end of the {model.config.context_length}-token context window "
                  "(--slide drops the oldest tokens and goes on)", file=sys.stderr)
    return 0


def _read_requests(args: argparse.Namespace, language_model: LanguageModel, config: GenerationConfig):
    """Prompt ids and RequestParams per line: the line's fields over the command's flags; ids
    outside the vocabulary are refused with the line's number."""
    defaults = dataclasses.asdict(config.sampling) | {
        "max_new_tokens": config.max_new_tokens, "seed": config.seed, "stop": config.stop,
        "eos_ids": config.eos_ids,
    }
    prompts, params = [], []
    with open(args.prompts_file, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                fields = json.loads(line)
                prompt = fields.pop("prompt")
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise ValueError(f"{args.prompts_file}:{number}: expected a JSON object with a prompt"
                                 ) from None
            try:
                params.append(RequestParams.from_fields(**(defaults | fields)))
                prompts.append(_prompt_ids(language_model.tokenizer, prompt, args.chat)
                               if isinstance(prompt, str) else language_model.encode(prompt))
            except (ValueError, TypeError) as error:
                raise ValueError(f"{args.prompts_file}:{number}: {error}") from None
    if not prompts:
        raise ValueError(f"{args.prompts_file}: no prompts")
    return prompts, params


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _run_many(args: argparse.Namespace, language_model: LanguageModel, config: GenerationConfig) -> int:
    if args.beams > 1 or args.no_cache or args.slide or args.truncate:
        raise ValueError("--prompts-file: --beams, --no-cache, --slide and --truncate need one prompt")
    prompts, params = _read_requests(args, language_model, config)
    engine = EngineConfig(kv_memory_mb=args.kv_memory_mb, kv_dtype=args.kv_dtype,
                          max_batch=args.max_batch)
    start, done = time.perf_counter(), [0, 0]

    def progress(index, result):
        done[0], done[1] = done[0] + 1, done[1] + result.n_generated
        rate = done[1] / (time.perf_counter() - start)
        print(f"\r[{done[0]}/{len(prompts)} requests, {rate:.1f} tok/s]", end="", file=sys.stderr, flush=True)

    results = language_model.generate_many(prompts, params=params, engine=engine, on_result=progress)
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
