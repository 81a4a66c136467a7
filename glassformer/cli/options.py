"""The command-line options shared by several commands, each defined once (FLAGS), and the
argument types that refuse bad values at parse time.

A flag means one thing, with one type and one default, in every command that takes it.
Where commands fall back to different values, the flag's default is None ("not given") and
its help names each command's fallback."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..accel.precision import Precision, choose_precision, use_precision
from ..accel.quantize import QUANTIZE_CHOICES
from ..errors import InputError
from ..formats.files import read_text
from ..generation.context_extension import EXTENSIONS
from ..generation.sampling import SamplingConfig
from ..interpret.journey.collect import MAX_TOKENS
from ..model.sink import SinkPolicy
from ..serving.engine import EngineConfig
from ..serving.graph_path import FLEX_BLOCK
from ..serving.kv_pool import KV_DTYPES

MAX_THREADS_PER_CORE = 16  # more is never faster, and a count past 2**31 overflows OpenMP's


def finite(text: str) -> float:
    """A float that is a number: nan and inf are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def non_negative(text: str) -> float:
    value = finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive(text: str) -> float:
    value = finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _integer(text: str, low: int, words: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1, "a positive integer")


def thread_count(text: str) -> int:
    """--threads: a positive count, at most MAX_THREADS_PER_CORE threads a core."""
    value, most = positive_int(text), MAX_THREADS_PER_CORE * (os.cpu_count() or 1)
    if value > most:
        raise argparse.ArgumentTypeError(f"{value} threads on {os.cpu_count()} cores: at most {most}")
    return value


def non_negative_int(text: str) -> int:
    return _integer(text, 0, "an integer >= 0")


def lora_spec(text: str) -> tuple[str, str]:
    """`NAME=PATH` or `PATH` (named after its folder): (name, path) of a LoRA adapter."""
    name, sep, path = text.partition("=")
    if not sep or "/" in name:
        name, path = Path(text).expanduser().resolve().name, text
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or PATH, got {text!r}")
    return name, path


def device(text: str) -> str:
    """A device this machine has: cpu, cuda[:N] with CUDA present, mps where available, auto."""
    from ..training.distributed import pick_device

    try:
        pick_device(text)
    except InputError as error:
        raise argparse.ArgumentTypeError(error.detail) from None
    return text


@dataclasses.dataclass(frozen=True)
class Flag:
    """One option: its spellings and its argparse settings (type or choices or action,
    default, help), the same in every command that takes it."""

    names: tuple[str, ...]
    settings: Mapping[str, Any]

    @property
    def name(self) -> str:
        return self.names[-1]


# The engine's settings a user may change, each a field of EngineConfig (the flag's type and
# default come from the field).
ENGINE_HELP = MappingProxyType({
    "kv_memory_mb": "KV cache size in MiB",
    "kv_dtype": "how the KV cache stores keys and values",
    "max_batch": "most requests in one engine step",
    "token_budget": "most tokens in one engine step (a long prompt is prefilled in chunks)",
    "block_size": "tokens per KV cache block",
    "prefix_caching": "reuse the cached keys and values of a prompt prefix seen before",
})
ENGINE_CHOICES = MappingProxyType({"kv_dtype": tuple(KV_DTYPES)})


def error_line(error: Exception, options: Iterable[str]) -> str:
    """The line a user's mistake prints. An error about a setting the command takes as an
    option (`options`: the parsed arguments' names) names it as the flag, and so do the other
    such settings its message names (kv_memory_mb -> --kv-memory-mb; names of one word, which
    read as words, only where they lead)."""
    options = {name.rpartition(".")[2] for name in options}  # train's model.d_model: --d-model
    if not isinstance(error, InputError) or error.field not in options:
        return str(error)
    flag = "--" + error.field.replace("_", "-")
    named = sorted((o for o in options if "_" in o), key=len, reverse=True)
    detail = re.sub(rf"\b({'|'.join(named)})\b", lambda m: "--" + m[1].replace("_", "-"),
                    error.detail) if named else error.detail
    return f"{flag}: {detail}"


def _engine_flag(field: dataclasses.Field, kind: type) -> Flag:
    help = f"{ENGINE_HELP[field.name]} (default: {field.default})"
    settings: dict[str, Any] = {"default": field.default, "help": help}
    if field.name in ENGINE_CHOICES:
        settings["choices"] = ENGINE_CHOICES[field.name]
    elif kind is bool:
        settings["action"] = argparse.BooleanOptionalAction
    else:
        settings["type"] = {int: positive_int, float: positive}[kind]
    return Flag(("--" + field.name.replace("_", "-"),), MappingProxyType(settings))


def _engine_flags() -> tuple[Flag, ...]:
    hints = typing.get_type_hints(EngineConfig)
    return tuple(_engine_flag(f, hints[f.name]) for f in dataclasses.fields(EngineConfig)
                 if f.name in ENGINE_HELP)


def _flag(*names: str, **settings: Any) -> Flag:
    return Flag(names, MappingProxyType(settings))


FLAGS: Mapping[str, Flag] = MappingProxyType({flag.name: flag for flag in (
    _flag("--model", default=None,
          help="a known name (see glassformer pull), a .gguf file, or a checkpoint or Hugging Face "
               "folder"),
    _flag("--preset", default=None,
          help="a named configuration with random weights, e.g. gpt2, tiny-llama (train also "
               "takes a recipe)"),
    _flag("--config", default=None,
          help='a JSON file: ModelConfig fields, or {"model": {...}, "train": {...}}'),
    _flag("--data", nargs="+", default=None,
          help="text file(s) or folder(s) (experiment: one, for ablation and length; default "
               "the packaged tinyshakespeare)"),
    _flag("--documents", choices=("file", "line", "blank"), default=None,
          help="where one document ends and the next begins (default: file; train: the run's)"),
    _flag("--batch-size", type=positive_int, default=None,
          help="sequences per batch (default: eval 8; train: the run's)"),
    _flag("--out", default=None,
          help="the run folder: a training run's checkpoints and metrics, an experiment's results "
               "(experiment default: experiment-NAME)"),
    _flag("-o", "--output", default=None,
          help="what to write: export a Hugging Face folder or a GGUF file, journey an HTML "
               "page (default journey.html)"),
    _flag("--force", action="store_true",
          help="replace what is there: pull downloads again, journey and export write over "
               "their output file"),
    _flag("--dtype", default=None,
          help="number format: train float32 or bfloat16 (autocast where supported); export "
               "--to gguf f32, f16, q8_0 or q4_0 (default f32)"),
    _flag("--json", action="store_true", help="print the result as JSON"),
    _flag("--no-progress", action="store_true", help="no progress bar"),
    _flag("--device", type=device, default=None,
          help="cpu, cuda, cuda:N, mps or auto (default: cpu; train: the run's, auto)"),
    _flag("--threads", type=thread_count, default=None,
          help="compute threads (default: GLASSFORMER_THREADS or OMP_NUM_THREADS if set, else "
               "one per core other processes leave free, looked at again during long runs)"),
    _flag("--quantize", choices=QUANTIZE_CHOICES, default=None,
          help="inference weights: none = float32 through the fast kernels, bf16 / int8 / int4 "
               "converted once, gguf = a GGUF file's own blocks (Q8_0, Q4_x, Q5_x, Q3_K to "
               "Q6_K; default: none; journey: the plain reference layers)"),
    _flag("--seed", type=int, default=None,
          help="seed of the random numbers: sampling (default: unseeded), a journey --preset's "
               "weights (default 0), training (default: the run's)"),
    _flag("-n", "--max-new-tokens", type=positive_int, default=None,
          help="at most this many new tokens (default: generate 64, chat 512)"),
    _flag("--max-tokens", type=positive_int, default=None,
          help="read at most this many tokens of the text: eval scores that many (default: all), "
               f"journey refuses a longer prompt (default {MAX_TOKENS})"),
    _flag("--top-k", type=positive_int, default=None,
          help="the K most likely next tokens: sampling draws among them only (default: all), "
               "fill-mask and journey list them (default 5 and 10)"),
    _flag("--temperature", type=non_negative, default=0.0, help="0 (default): greedy"),
    _flag("--top-p", type=finite, default=1.0, help="sample from the smallest set of tokens this "
          "likely together (default 1: all)"),
    _flag("--min-p", type=finite, default=0.0,
          help="drop tokens less likely than this fraction of the likeliest (default 0)"),
    _flag("--repetition-penalty", type=finite, default=1.0,
          help="divide the logits of tokens already seen by this (default 1: none)"),
    _flag("--presence-penalty", type=finite, default=0.0,
          help="subtract this from the logits of tokens already seen (default 0)"),
    _flag("--frequency-penalty", type=finite, default=0.0,
          help="subtract this times their count from the logits of tokens seen (default 0)"),
    _flag("--rope-scaling", choices=EXTENSIONS, default=None,
          help="extend a RoPE model's context window --rope-factor times (default: none; train: "
               "the run's)"),
    _flag("--rope-factor", type=positive, default=None,
          help="new context / original context (default: generate 2; train: the run's)"),
    _flag("--prompt-file", default=None, help="read the prompt from this UTF-8 file"),
    _flag("--context", choices=("full", "sink", "retrieve"), default="full",
          help="what the model attends to: full = every token up to the window (default), sink = "
               "the first --sink-tokens and the last --window tokens, streaming past the window; "
               "retrieve (generate) = the prompt is a document cut into chunks, and only the "
               "chunks that best match --question and fit the window go before it"),
    _flag("--sink-tokens", type=non_negative_int, default=4,
          help="--context sink: the first tokens kept forever (default 4; 0: window only)"),
    _flag("--window", type=positive_int, default=None,
          help="--context sink: the latest tokens kept (required with it)"),
    _flag("--lora", type=lora_spec, action="append", default=None, metavar="[NAME=]PATH",
          help="a LoRA adapter folder (PEFT layout, or a LoRA run): generate folds one into the "
               "weights; serve serves each (repeat the flag) under NAME, which a request's model "
               "field picks (default NAME: the folder's name)"),
    _flag("--steer", action="append", default=None, metavar="SPEC",
          help="a steering vector file (glassformer steer build): generate PATH[:ALPHA] adds "
               "ALPHA (default 1) x the vector at its site for every token; serve NAME=PATH "
               "registers it under NAME for requests to steer with"),
    _flag("--compile", action="store_true",
          help="torch.compile: generate and chat decode with the one-token step compiled "
               "over fixed KV buffers (CUDA graphs on a GPU), the plain weights, the first steps "
               "slow while it compiles; serve and --prompts-file: the engine's plain decoding "
               "rows compiled per batch bucket over the paged pool (FlexAttention); train "
               "compiles the model its steps run (default: the recipe's)"),
    _flag("--deterministic", action="store_true",
          help="on a GPU, a request's tokens bit for bit independent of what shares its batch: "
               "deterministic algorithms, no TF32, products and norms in fixed row tiles, one "
               "attention call per request, --compile's graph at one fixed batch size (slower); "
               "on the CPU the engine is batch invariant already and this changes nothing"),
    *_engine_flags(),
)})

SAMPLING = ("--temperature", "--top-k", "--top-p", "--min-p", "--repetition-penalty",
            "--presence-penalty", "--frequency-penalty")
ENGINE = tuple("--" + name.replace("_", "-") for name in ENGINE_HELP)
CONTEXT = ("--context", "--sink-tokens", "--window")


def add(parser, *names: str, required: bool = False, dest: str | None = None) -> None:
    """Add the table's flags `names` to a parser (or an argument group); `required` and
    `dest` are the only things a command chooses."""
    for name in names:
        flag = FLAGS[name]
        extra = ({"required": True} if required else {}) | ({"dest": dest} if dest else {})
        parser.add_argument(*flag.names, **flag.settings, **extra)


def add_threads(parser: argparse.ArgumentParser) -> None:
    """--threads (main() makes the thread policy from it)."""
    parser.set_defaults(thread_policy=None)
    add(parser, "--threads")


def settle_threads(args: argparse.Namespace) -> None:
    """Fix the thread count of main()'s policy before the command computes: called once the
    command has loaded its model, so that the loading fills the policy's measuring window."""
    if args.thread_policy is not None:
        args.thread_policy.settle()


def add_computing(parser: argparse.ArgumentParser) -> None:
    """--device and --threads: the flags of every command that computes."""
    add(parser, "--device")
    add_threads(parser)


def engine_config(args: argparse.Namespace, device: str = "cpu") -> EngineConfig:
    """The EngineConfig that the ENGINE and CONTEXT flags describe, on `device`. With --compile
    on CUDA, KV blocks left at their default hold FLEX_BLOCK tokens, as the graph executor's
    FlexAttention needs there (named on stderr)."""
    settings = {name: getattr(args, name) for name in ENGINE_HELP}
    graph = getattr(args, "compile", False)
    default_block = EngineConfig.block_size  # the dataclass field's default
    if graph and device.startswith("cuda") and settings["block_size"] == default_block:
        settings["block_size"] = FLEX_BLOCK
        print(f"glassformer: KV blocks of {FLEX_BLOCK} tokens (the graph executor's FlexAttention on "
              "CUDA)", file=sys.stderr)
    return EngineConfig(**settings, sink=sink_policy(args), compile=graph,
                        deterministic=getattr(args, "deterministic", False))


def inference_precision(args: argparse.Namespace) -> tuple[str, Precision]:
    """generate, chat and serve: the device (--device, default cpu) and the weights and
    products chosen for it from --quantize, --compile and --deterministic (accel/precision.py),
    the process set up for them; on CUDA the choice is named on stderr."""
    from ..training.distributed import pick_device

    device = pick_device(or_default(args.device, "cpu"))
    precision = choose_precision(device.type, args.quantize, args.compile, args.deterministic)
    use_precision(precision)
    if device.type == "cuda":
        print(f"glassformer: {precision.describe()}", file=sys.stderr)
    return str(device), precision


def sink_policy(args: argparse.Namespace, retrieve: bool = False) -> SinkPolicy | None:
    """The CONTEXT flags' SinkPolicy, or None for the full context (or, where the command
    takes it, `retrieve`)."""
    if args.context != "sink":
        if args.window is not None:
            raise InputError("--window", "only with --context sink")
        if args.context == "retrieve" and not retrieve:
            raise InputError(None, "--context retrieve: generate's (a document, chunks and a --question)")
        return None
    if args.window is None:
        raise InputError("--window", "--context sink needs the number of latest tokens to keep")
    return SinkPolicy(args.sink_tokens, args.window)


def sampling_config(args: argparse.Namespace) -> SamplingConfig:
    """The SamplingConfig that the SAMPLING flags describe."""
    return SamplingConfig(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )


def or_default(value, fallback):
    """A flag's value, or the command's own fallback where it was not given."""
    return fallback if value is None else value


def add_prompt(parser: argparse.ArgumentParser, what: str) -> None:
    """PROMPT as an argument, `-` for standard input, or --prompt-file F (an argument is
    capped by the OS near 128 KiB)."""
    parser.add_argument("prompt", nargs="?", help=f"{what} ('-' reads standard input)")
    add(parser, "--prompt-file")


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from the argument, standard input or --prompt-file, checked to be UTF-8."""
    if (args.prompt is None) == (args.prompt_file is None):
        raise InputError(None, "give a prompt or --prompt-file, not both" if args.prompt is not None
                         else "no prompt: give one, '-' for standard input, or --prompt-file")
    if args.prompt_file is not None:
        return read_text(args.prompt_file)
    if args.prompt == "-":
        return _utf8(sys.stdin.buffer.read(), "standard input")
    return checked_text(args.prompt, "the prompt")


def checked_text(text: str, where: str) -> str:
    """Text from argv or a terminal holds lone surrogates where its bytes were not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InputError(None, f"{where} is not valid UTF-8 (character {error.start})") from None
    return text


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(where, f"not valid UTF-8 (byte {error.start})") from None
