"""`glassformer generate`: continue a prompt, streaming the text as it is made."""

from __future__ import annotations

import argparse
import json
import sys

from ..accel.quantize import quantize_format, quantize_model
from ..generation.context_extension import extend_context
from ..generation.generate import GenerationConfig, generate, stream
from ..language_model import load
from .options import (
    add_prompt,
    add_quantize,
    add_sampling,
    device,
    finite,
    positive_int,
    read_prompt,
    sampling_config,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="continue a prompt with a model")
    add_prompt(parser, "the text to continue")
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
    parser.set_defaults(run=run)


def _prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return tokenizer.encode(prompt)
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError("--chat: this model's tokenizer has no chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])


def run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
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
    if extend:
        model = extend_context(model, args.rope_scaling, args.rope_factor)
        quantize_model(model, quantize_format(args.quantize))
    model = model.to(args.device)
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
