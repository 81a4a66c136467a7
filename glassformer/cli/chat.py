"""`glassformer chat`: talk to a chat model in the terminal, the reply streamed as it is made."""

from __future__ import annotations

import argparse
import sys

from ..errors import InputError
from .options import (
    CONTEXT,
    SAMPLING,
    add,
    add_computing,
    checked_text,
    inference_precision,
    or_default,
    positive_int,
    sampling_config,
    settle_threads,
    sink_policy,
)
from .waits import announce, announce_compile

MODEL, MAX_NEW_TOKENS = "smollm2-135m-instruct", 512
HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("chat", help="an interactive chat with a model",
                                   description=f"Talk to --model (default {MODEL}); {HELP}.")
    add(parser, "--model")
    parser.add_argument("--system", default=None, help="a system message")
    add(parser, "--max-new-tokens", *SAMPLING, "--seed", "--quantize", "--compile", "--kv-dtype")
    parser.add_argument("--max-context", type=positive_int, default=2048,
                        help="tokens of conversation kept in the KV cache (--context full)")
    add(parser, *CONTEXT)
    add(parser, "--deterministic")
    add_computing(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..generation.chat import ChatSession
    from ..language_model import load

    model = or_default(args.model, MODEL)
    device, precision = inference_precision(args)
    language_model = load(model, quantize=precision.quantize, announce=announce)
    announce_compile(args.compile)
    settle_threads(args)
    precision.place(language_model.model, device)
    session = ChatSession(language_model.model, language_model.tokenizer, sampling_config(args),
                          or_default(args.max_new_tokens, MAX_NEW_TOKENS), args.system, args.max_context,
                          args.seed, args.kv_dtype, sink_policy(args), args.compile)
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 is reported, not fatal
        sys.stdin.reconfigure(errors="surrogateescape")
    if interactive:
        print(f"chatting with {model}; {HELP}", file=sys.stderr)
    while True:
        try:
            text = input("you> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if text.strip() in ("/exit", "/quit"):
            return 0
        if text.strip() == "/reset":
            session.reset()
            continue
        if not text.strip():
            continue
        try:
            checked_text(text, "that line")
        except InputError as error:
            print(f"glassformer: {error}; type it again", file=sys.stderr)
            continue
        print("assistant> " if interactive else "", end="", flush=True)
        try:
            for piece in session.reply(text):
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        print(flush=True)
