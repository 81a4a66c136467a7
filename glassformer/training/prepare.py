"""Before a run writes anything: every check that could refuse it, and what the checks load.

A fresh run trains its tokenizer (or takes the pretrained model's with `init`); a resumed run
reads the tokenizer, model config and checkpoint from its folder, and refuses any setting
that would change the math of a step (budgets may change). A refused fresh run leaves nothing
behind (`remove_new_run`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from ..errors import InputError
from ..formats.checkpoint import Checkpoint, resume_source, run_contents
from ..formats.files import check_location
from ..formats.tokenizers import train_tokenizer
from ..model.config import ModelConfig
from ..model.sizes import check_fits, check_model_fits
from .chat_data import is_chat_data
from .config import TrainConfig, resume_conflicts
from .data import iter_documents, list_sources
from .lora import check_targets
from .objectives import get_objective
from .pretrained import load_pretrained, run_config


class Prepared(NamedTuple):
    sources: list[Path]
    tokenizer: Any
    model_config: ModelConfig
    checkpoint: Checkpoint | None  # the checkpoint to resume, if any
    pretrained: Any  # the pretrained model (--init) whose weights the run starts from, if any


def prepare_run(data, out: Path, model_config, config: TrainConfig, resume: bool,
                announce=None) -> Prepared:
    """Checks everything that could refuse the run before anything is written; `announce`
    is told of a BPE tokenizer trained (seconds on a large text)."""
    objective = get_objective(config.objective)
    sources = list_sources(data)
    if is_chat_data(sources) and (config.init is None or config.objective != "clm"):
        raise InputError("data", "chat data (.jsonl) fine-tunes a pretrained chat model: pass "
                         "--init, with the default objective clm")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out}: not a folder (--out names the run folder)")
    check_location(out, makes_folders=True)  # not under a regular file
    if isinstance(model_config, ModelConfig):
        check_step_fits(model_config, config)
    if not resume:
        left = run_contents(out)
        if left:
            raise InputError(None, f"{out} already holds a training run ({', '.join(left[:4])}"
                             f"{' ...' if len(left) > 4 else ''}): pass --resume to continue it, "
                             "or give a fresh --out")
        if config.init is not None:  # the pretrained model's config, weights and tokenizer
            pretrained, tokenizer = load_pretrained(config.init)
            if tokenizer.eos_id is None:  # documents are joined with it
                raise InputError("init", f"{config.init}'s tokenizer has no end-of-text token")
            model_config = run_config(pretrained.config, model_config, config.init)
            objective.check(model_config)
            if config.lora is not None:
                check_targets(model_config, config.lora)
            return Prepared(sources, tokenizer, model_config, None, pretrained)
        objective.check(model_config)
        docs = iter_documents(sources, config.documents)
        if announce is not None and config.tokenizer == "bpe":
            announce(f"training a BPE tokenizer of up to {config.vocab_size} tokens on the text")
        tokenizer = train_tokenizer(config.tokenizer, docs, config.vocab_size)
        tokenizer = objective.prepare_tokenizer(tokenizer, model_config.context_length)
        return Prepared(sources, tokenizer, _for_tokenizer(model_config, tokenizer), None, None)
    checkpoint = Checkpoint.open(resume_source(out))
    tokenizer = checkpoint.tokenizer()
    if config.init is not None:  # the saved model is the run's; asked fields must agree with it
        asked = model_config.to_dict() if isinstance(model_config, ModelConfig) else model_config
        model_config = checkpoint.config.replace(**(asked or {}))
    else:
        model_config = _for_tokenizer(model_config, tokenizer)
    saved, asked = checkpoint.config.to_dict(), model_config.to_dict()
    conflicts = [f"{k}={asked[k]!r} (saved {saved[k]!r})" for k in saved if saved[k] != asked[k]]
    conflicts += resume_conflicts(TrainConfig.from_dict(checkpoint.meta["train"]), config)
    if conflicts:
        raise InputError(None, f"cannot resume {out}: this run asks for {', '.join(conflicts)}")
    pretrained = load_pretrained(config.init)[0] if config.lora is not None else None  # the base
    return Prepared(sources, tokenizer, model_config, checkpoint, pretrained)


def check_step_fits(model_config: ModelConfig, config: TrainConfig) -> None:
    """Refuse sizes whose step could never fit this machine, before anything is built: the
    model's weights (sizes.check_model_fits), a step's windows of token ids and their targets
    (int64), and one micro-batch's residual stream (float32)."""
    check_model_fits(model_config)
    sizes = {"batch_size": config.batch_size, "grad_accum": config.grad_accum,
             "context_length": model_config.context_length, "d_model": model_config.d_model}
    step, T = config.grad_accum * config.batch_size, model_config.context_length
    check_fits(16 * step * T, "cpu", max(("batch_size", "grad_accum", "context_length"), key=sizes.get),
               f"a step of {step:,} windows of {T:,} tokens")
    check_fits(4 * config.batch_size * T * model_config.d_model, "cpu",
               max(("batch_size", "context_length", "d_model"), key=sizes.get),
               f"the residual stream of {config.batch_size:,} windows of {T:,} tokens")


def _for_tokenizer(model_config: ModelConfig, tokenizer) -> ModelConfig:
    """The model's vocabulary is the tokenizer's; an encoder-decoder's decoder starts from
    end-of-text."""
    if model_config.n_encoder_layers:
        return model_config.replace(vocab_size=tokenizer.vocab_size, decoder_start_id=tokenizer.eos_id)
    return model_config.replace(vocab_size=tokenizer.vocab_size)


def remove_new_run(out: Path, created: bool) -> None:
    """What a refused fresh run wrote: its token file, and its folder if it made it."""
    for name in ("tokens.bin", "tokens.json", "tokens.bin.tmp"):
        (out / name).unlink(missing_ok=True)
    if created and out.is_dir() and not any(out.iterdir()):
        out.rmdir()
