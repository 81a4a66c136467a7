"""`glassformer experiment NAME`: run (or resume) one of the textbook's claims as an experiment."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import InputError
from ..formats.files import check_location
from .options import add, add_threads, positive, positive_int, settle_threads

NAMES = ("ablation", "length", "cache", "explain", "recall")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "experiment", help="check a claim about transformers on this machine",
        description="Train or measure small models to check one claim; writes report.html, "
                    "results.json and the plots into --out. Rerunning with the same --out "
                    "resumes: finished cells are not run again.",
    )
    parser.add_argument("name", choices=NAMES, help="which experiment")
    parser.add_argument("--budget", type=positive, default=600.0,
                        help="seconds of work to plan for (default 600; planned as for an "
                             "idle machine, so a busy one takes longer)")
    add(parser, "--out", "--data")
    parser.add_argument("--equal", choices=("time", "steps"), default=None,
                        help="ablation: give every run equal training time (default) or, on a busy "
                             "machine, as many steps as the base run made in its time")
    parser.add_argument("--models", nargs="+", metavar="NAME", default=None,
                        help="recall: which models (default: smollm2-135m-instruct and the "
                             "length experiment's RoPE model, shakespeare-rope)")
    parser.add_argument("--max-length", type=positive_int, default=None,
                        help="recall: the longest prompt in tokens (default: 8x each model's window)")
    parser.add_argument("--min-length", type=positive_int, default=None,
                        help="recall: the shortest prompt in tokens besides the window's own, which "
                             "the readings past it are judged against (default: each model's shortest)")
    parser.add_argument("--retrieve-tokens", type=positive_int, default=None,
                        help="recall: the longest prompt the retrieve reading builds (default 1024)")
    add(parser, "--device", "--no-progress", "--json")
    add_threads(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:

    from ..experiments import run_experiment
    from ..experiments.report import text_summary

    options = {}
    if args.equal is not None:
        if args.name != "ablation":
            raise InputError("--equal", "applies to the ablation experiment only")
        options["equal"] = args.equal
    for flag, value in (("--models", args.models), ("--max-length", args.max_length),
                        ("--min-length", args.min_length), ("--retrieve-tokens", args.retrieve_tokens)):
        if value is not None:
            if args.name != "recall":
                raise InputError(flag, "applies to the recall experiment only")
            options[flag[2:].replace("-", "_")] = tuple(value) if flag == "--models" else value
    if args.data is not None and args.name not in ("ablation", "length", "recall"):
        raise InputError("--data", f"the {args.name} experiment reads no training text")
    if args.data is not None and len(args.data) > 1:
        raise InputError("--data", f"the {args.name} experiment reads one file or folder")
    out = args.out or f"experiment-{args.name}"
    if Path(out).exists() and not Path(out).is_dir():
        raise InputError("--out", f"{out} is a file; give a folder")
    check_location(out, makes_folders=True)
    settle_threads(args)
    record = run_experiment(args.name, out, args.budget, args.data and args.data[0],
                            progress=not args.no_progress, device=args.device, **options)
    if args.json:
        print(json.dumps({"experiment": args.name, "out": str(out),
                          "report": f"{out}/report.html", **record["summary"],
                          "settings": record["settings"], "machine": record["machine"]}))
    else:
        print(text_summary(record["summary"]))
        print(f"\nreport: {out}/report.html")
    return 0
