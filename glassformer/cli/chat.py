"""`glassformer chat`: talk to a chat model in the terminal, the reply streamed as it is made."""

from __future__ import annotations

import argparse
import sys

from .options import add_quantize, add_sampling, add_threads, checked_text, positive_int, sampling_config

HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("chat", help="an interactive chat with a model")
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a .gguf file, HF folder, checkpoint folder or known name "
                             "(default: smollm2-135m-instruct)")
    parser.add_argument("--system", default=None, help="a system message")
    parser.add_argument("-n", "--max-new-tokens", type=positive_int, default=512)
    add_sampling(parser)
    parser.add_argument("--seed", type=int, default=None)
    add_quantize(parser)
    parser.add_argument("--max-context", type=positive_int, default=2048,
                        help="tokens of conversation kept in the KV cache")
    add_threads(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..generation.chat import ChatSession
    from ..language_model import load

    language_model = load(args.model, quantize=args.quantize)
    session = ChatSession(language_model.model, language_model.tokenizer, sampling_config(args),
                          args.max_new_tokens, args.system, args.max_context, args.seed)
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 is reported, not fatal
        sys.stdin.reconfigure(errors="surrogateescape")
    if interactive:
        print(f"chatting with {args.model}; {HELP}", file=sys.stderr)
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
        except ValueError as error:
            print(f"glassformer: {error}; type it again", file=sys.stderr)
            continue
        print("assistant> " if interactive else "", end="", flush=True)
        try:
            for piece in session.reply(text):
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        print(flush=True)
