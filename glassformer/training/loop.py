"""The training loop, as a library function: `train(data, out_dir, model_config, train_config)`.

One optimizer step draws world_size · grad_accum · batch_size windows with the run's seeded
generator; each process takes its own slice, so the result does not depend on how many
processes share the work. AdamW (decay on matrices only) or Muon + AdamW (optim.py), warmup +
cosine, clipping, accumulation; evaluation on a fixed set of validation windows; checkpoints
that resume exactly.
"""

from __future__ import annotations

import math
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from ..accel.decisions import bf16_products_pay
from ..accel.fast_training import clip_grad_norm_, use_fast_training
from ..accel.threads import ThreadPolicy
from ..errors import InputError
from ..formats.checkpoint import Checkpoint, resume_source, run_contents, save_to_run
from ..formats.files import check_location
from ..formats.peft import read_adapter
from ..formats.tokenizers import train_tokenizer
from ..generation.config import GenerationConfig
from ..generation.generate import generate
from ..generation.sampling import SamplingConfig
from ..model.config import ModelConfig
from ..model.encoder_decoder import EncoderDecoder, build_model
from ..model.transformer import Transformer
from . import distributed
from .allocator import keep_freed_memory
from .chat_data import ChatData, ChatSFT, is_chat_data
from .config import TrainConfig, resume_conflicts
from .data import TokenData, draw_starts, iter_documents, list_sources, windows, write_token_file
from .lora import add_lora, check_targets, load_adapter_tensors, save_adapter
from .masking import IGNORE
from .metrics import MetricsLog, plot_losses
from .objectives import OBJECTIVES, Batch, get_objective
from .optim import make_optimizer, set_learning_rate
from .pretrained import base_name, load_pretrained, run_config
from .schedule import learning_rate


def autocast(device: torch.device, dtype: str):
    """bf16 autocast where bf16 products pay (CUDA support; measured on a CPU); else float32."""
    if dtype == "bfloat16" and bf16_supported(device):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bf16_products_pay()  # measured once per CPU


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, reduction="mean"):
    return OBJECTIVES["clm"].loss(model, (x, y), reduction)


def train_step(model, optimizer, x, y, grad_accum: int, grad_clip: float, amp,
               objective=OBJECTIVES["clm"], batch: Batch | None = None) -> torch.Tensor:
    """One optimizer step over `grad_accum` micro-batches of (x, y) (n, T), or of the
    objective's `batch` made from them. Returns the loss."""
    batch = (x, y) if batch is None else batch
    total = torch.zeros((), device=x.device)
    for i, micro in enumerate(zip(*(t.chunk(grad_accum) for t in batch), strict=True)):
        last = i == grad_accum - 1
        sync = nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with amp:
                loss = objective.loss(model, micro) / grad_accum
            loss.backward()
        total += loss.detach()
    if grad_clip:
        clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


@torch.no_grad()
def evaluate(model, tokens, starts, context_length, batch_size, process, amp,
             objective=OBJECTIVES["clm"], tokenizer=None) -> float:
    """Mean validation loss over the windows at `starts` (this process's share). A random
    objective draws each window's randomness from its start: the same at every evaluation,
    whatever the number of processes."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=process.device)  # (loss sum, tokens)
    for chunk in starts.split(batch_size):
        x, y = windows(tokens, chunk, context_length, process.device)
        masks = [objective.draw_masks(1, context_length, torch.Generator().manual_seed(int(s)))
                 for s in chunk]
        batch = objective.batch(x, y, tokenizer, None if masks[0] is None else torch.cat(masks))
        with amp:
            totals[0] += objective.loss(model, batch, reduction="sum").double()
        totals[1] += (batch[-1] != IGNORE).sum()  # the targets that count
    distributed.all_reduce_sum(process, totals)
    model.train()
    return (totals[0] / totals[1]).item()


@torch.no_grad()
def evaluate_chat(model, chat: ChatData, rows: torch.Tensor, batch_size: int, process, amp) -> float:
    """Mean validation loss per counted target over the packed validation windows `rows`
    (this process's share)."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=process.device)  # (loss sum, targets)
    for chunk in rows.split(batch_size):
        batch = chat.val.batch(chunk, process.device)
        with amp:
            totals[0] += ChatSFT().loss(model, batch, reduction="sum").double()
        totals[1] += (batch[-1] != IGNORE).sum()
    distributed.all_reduce_sum(process, totals)
    model.train()
    return (totals[0] / totals[1]).item()


def sample_text(model: Transformer | EncoderDecoder, tokenizer, n_tokens: int, seed: int,
                temperature: float = 0.8) -> str:
    """Text drawn after an end-of-text token, through the generation loop; past the context
    the window slides to its most recent half (an encoder-decoder's output stops there)."""
    seq2seq = bool(model.config.n_encoder_layers)
    n_tokens = min(n_tokens, model.config.context_length) if seq2seq else n_tokens
    config = GenerationConfig(max_new_tokens=n_tokens, sampling=SamplingConfig(temperature=temperature),
                              seed=seed, eos_ids=(), overflow="stop" if seq2seq else "slide",
                              use_cache=model.config.causal)
    return generate(model, [tokenizer.eos_id], config, tokenizer).text


def _prepare(data, out: Path, model_config, config: TrainConfig, resume: bool, process):
    """Checks everything that could refuse the run before anything is written. Returns
    (sources, tokenizer, model config, checkpoint to resume or None, pretrained model or None)."""
    objective = get_objective(config.objective)
    sources = list_sources(data)
    if is_chat_data(sources) and (config.init is None or config.objective != "clm"):
        raise InputError("data", "chat data (.jsonl) fine-tunes a pretrained chat model: pass "
                         "--init, with the default objective clm")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out}: not a folder (--out names the run folder)")
    check_location(out, makes_folders=True)  # not under a regular file
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
            return sources, tokenizer, model_config, None, pretrained
        objective.check(model_config)
        docs = iter_documents(sources, config.documents)
        tokenizer = train_tokenizer(config.tokenizer, docs, config.vocab_size)
        tokenizer = objective.prepare_tokenizer(tokenizer, model_config.context_length)
        return sources, tokenizer, _for_tokenizer(model_config, tokenizer), None, None
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
    return sources, tokenizer, model_config, checkpoint, pretrained


def _for_tokenizer(model_config: ModelConfig, tokenizer) -> ModelConfig:
    """The model's vocabulary is the tokenizer's; an encoder-decoder's decoder starts from
    end-of-text."""
    if model_config.n_encoder_layers:
        return model_config.replace(vocab_size=tokenizer.vocab_size, decoder_start_id=tokenizer.eos_id)
    return model_config.replace(vocab_size=tokenizer.vocab_size)


def train(data, out_dir, model_config: ModelConfig | dict | None, config: TrainConfig,
          resume: bool = False, progress: bool = True, echo=tqdm.write,
          threads: ThreadPolicy | None = None) -> dict:
    """Train on the text at `data` (file(s) or folder) into the run folder `out_dir`.
    With `config.init` the model is the pretrained one: `model_config` may then be None or
    give fields (a dict) that must agree with it (see training/pretrained.py).
    `echo` prints the evaluations and samples; `threads` (the process's policy, if any) is
    revisited every step. Returns a summary (iters, losses, tokens/s, checkpoint path ...)."""
    started = time.perf_counter()
    keep_freed_memory()
    process = distributed.setup(config.device)
    try:
        return _train(data, Path(out_dir), model_config, config, resume, progress, echo,
                      process, started, threads)
    finally:
        distributed.teardown(process)


def _train(data, out, model_config, config, resume, progress, echo, process, started, threads):
    sources, tokenizer, model_config, checkpoint, pretrained = _prepare(
        data, out, model_config, config, resume, process
    )
    T, main, device = model_config.context_length, process.is_main, process.device
    chat = ChatData.build(sources, tokenizer, T, config.val_fraction) \
        if is_chat_data(sources) else None
    created = not out.exists()
    distributed.barrier(process)  # every rank has checked the run folder before rank 0 writes
    try:
        if main:
            out.mkdir(parents=True, exist_ok=True)
            if chat is None:
                write_token_file(sources, tokenizer, out / "tokens.bin", config.documents)
        distributed.barrier(process)
        tokens = None if chat else TokenData.open(out / "tokens.bin", T, config.val_fraction)
        torch.manual_seed(config.seed)
        model = build_model(model_config)
        if pretrained is not None:
            model.load_state_dict(pretrained.state_dict(), strict=True)
            del pretrained
        model = use_fast_training(model.to(device))  # fused C++ passes on a CPU
        lora = config.lora
        if lora is not None:  # the base frozen, adapters on its targets
            add_lora(model, lora)
        optimizer = make_optimizer(model, config)  # for the parameters that train
    except BaseException:
        if main and checkpoint is None:  # a refused fresh run leaves nothing behind
            _remove_new_run(out, created)
        raise
    data_gen = torch.Generator().manual_seed(config.seed)
    state = {"step": 0, "tokens_seen": 0, "best_val_loss": math.inf, "train_seconds": 0.0}
    if checkpoint is not None:
        if lora is not None:  # the base came from config.init
            load_adapter_tensors(model, read_adapter(checkpoint.folder)[1], str(checkpoint.folder))
        else:
            checkpoint.load_weights(model, device)
        checkpoint.load_optimizer(optimizer)
        saved = checkpoint.training_state()
        data_gen.set_state(saved["rng.data"])
        torch.set_rng_state(saved["rng.torch"])
        state.update(checkpoint.meta["state"])
    metrics = MetricsLog(out / "metrics.jsonl", enabled=main)
    metrics.truncate_after(state["step"])  # a fresh run starts a fresh log

    step_model = torch.compile(model) if config.compile else model
    if process.world_size > 1:
        step_model = DistributedDataParallel(
            step_model, device_ids=[device.index] if device.type == "cuda" else None
        )
    amp = autocast(device, config.dtype)
    n_local = config.grad_accum * config.batch_size
    mine = slice(process.rank * n_local, (process.rank + 1) * n_local)
    if chat is None:
        val_starts = draw_starts(len(tokens.val), T, config.eval_iters * config.batch_size,
                                 torch.Generator().manual_seed(config.seed + 1))
    else:  # the first validation windows, in order
        val_starts = torch.arange(min(len(chat.val), config.eval_iters * config.batch_size))
    val_starts = val_starts[process.rank::process.world_size]
    objective = ChatSFT() if chat else get_objective(config.objective)
    tokens_per_step = process.world_size * n_local * T

    def write_adapter(folder: Path) -> None:
        save_adapter(folder, model, lora, base_name(config.init))

    def save(links):
        meta = {"train": config.to_dict(), "state": dict(state)}
        rng = {"rng.data": data_gen.get_state(), "rng.torch": torch.get_rng_state()}
        if main:
            save_to_run(out, state["step"], links, model, tokenizer, meta, optimizer, rng,
                        None if lora is None else write_adapter)

    def run_eval(train_loss):
        if chat is None:
            val_loss = evaluate(step_model, tokens.val, val_starts, T, config.batch_size,
                                process, amp, objective, tokenizer)
        else:
            val_loss = evaluate_chat(step_model, chat, val_starts, config.batch_size, process, amp)
        _check_finite("validation loss", val_loss, state["step"], out)
        best = val_loss < state["best_val_loss"]
        state["best_val_loss"] = min(val_loss, state["best_val_loss"])
        state["val_step"], state["val_loss"] = state["step"], val_loss  # kept for a resume
        record = {"iter": state["step"], "val_loss": val_loss, "val_perplexity": math.exp(val_loss),
                  "train_loss": train_loss, "best": best,
                  "elapsed": time.perf_counter() - started}
        if main and config.sample_tokens and model_config.causal:  # an encoder writes no text
            record["sample"] = sample_text(model, tokenizer, config.sample_tokens,
                                           seed=config.seed + state["step"])
        metrics.append(record)
        if main:
            echo(f"step {state['step']}: val loss {val_loss:.4f} (perplexity "
                 f"{math.exp(val_loss):.2f}){' best' if best else ''}")
            if record.get("sample"):
                echo(record["sample"])
        save(("latest", "best") if best else ("latest",))
        return val_loss

    interrupted = []
    previous = _on_sigint(lambda: interrupted.append(True))
    bar = tqdm(total=config.max_iters, initial=state["step"], disable=not (main and progress),
               unit="it", dynamic_ncols=True)
    loop_start, run_tokens, run_train_seconds = time.perf_counter(), 0, 0.0
    # a run resumed at an evaluated step logs (and evaluates) that step no second time
    train_loss, val_loss, last_eval = math.nan, state.get("val_loss", math.nan), state.get("val_step", -1)
    try:
        while state["step"] < config.max_iters and not interrupted:
            if config.max_time and time.perf_counter() - loop_start >= config.max_time:
                break
            if threads is not None:
                threads.revisit()  # other work on this CPU comes and goes
            t0 = time.perf_counter()
            lr = learning_rate(state["step"], config.lr, config.min_lr, config.warmup_iters,
                               config.decay_iters)
            set_learning_rate(optimizer, lr, config)
            if chat is None:
                starts = draw_starts(len(tokens.train), T, process.world_size * n_local, data_gen)
                x, y = windows(tokens.train, starts[mine], T, device)
                masks = objective.draw_masks(process.world_size * n_local, T, data_gen)  # every row's
                batch = objective.batch(x, y, tokenizer, None if masks is None else masks[mine])
            else:
                rows = torch.randint(0, len(chat.train), (process.world_size * n_local,),
                                     generator=data_gen)
                batch = chat.train.batch(rows[mine], device)
                x, y = batch[0], batch[-1]
            loss = train_step(step_model, optimizer, x, y, config.grad_accum, config.grad_clip, amp,
                              objective, batch)
            state["step"] += 1
            state["tokens_seen"] += tokens_per_step
            run_tokens += tokens_per_step
            seconds = time.perf_counter() - t0
            run_train_seconds += seconds
            state["train_seconds"] += seconds
            bar.update(1)
            if state["step"] % config.log_interval == 0 or state["step"] == config.max_iters:
                train_loss = distributed.all_reduce_sum(process, loss).item() / process.world_size
                _check_finite("training loss", train_loss, state["step"], out)
                rate = run_tokens / max(run_train_seconds, 1e-9)
                bar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{rate:,.0f}", refresh=False)
                metrics.append({"iter": state["step"], "train_loss": train_loss, "lr": lr,
                                "tokens_seen": state["tokens_seen"], "tokens_per_second": rate})
            if state["step"] % config.eval_interval == 0:
                val_loss, last_eval = run_eval(train_loss), state["step"]
        if interrupted:
            save(("latest",))
        elif last_eval != state["step"]:
            val_loss = run_eval(train_loss)
    finally:
        bar.close()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if main and (out / "metrics.jsonl").is_file():
        plot_losses(out / "metrics.jsonl", out / "loss.png")
    if interrupted:
        raise KeyboardInterrupt
    distributed.barrier(process)  # no rank returns before rank 0 has saved the run
    return {
        "iters": state["step"], "tokens_seen": state["tokens_seen"], "train_loss": train_loss,
        "val_loss": val_loss, "val_perplexity": math.exp(val_loss) if val_loss == val_loss else None,
        "best_val_loss": state["best_val_loss"],
        "tokens_per_second": run_tokens / max(run_train_seconds, 1e-9),
        "wall_seconds": time.perf_counter() - started, "checkpoint": str(out / "latest"),
        "best_checkpoint": str(out / "best"), "metrics": str(out / "metrics.jsonl"),
        "loss_curve": str(out / "loss.png"), "world_size": process.world_size,
        "rank": process.rank,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "dtype": "bfloat16" if config.dtype == "bfloat16" and bf16_supported(device) else "float32",
    }


def _remove_new_run(out: Path, created: bool) -> None:
    for name in ("tokens.bin", "tokens.json", "tokens.bin.tmp"):
        (out / name).unlink(missing_ok=True)
    if created and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def _check_finite(name: str, value: float, step: int, out: Path) -> None:
    """A diverged run stops before it logs or saves anything non-finite."""
    if not math.isfinite(value):
        kept = f"; the last good checkpoint is {(out / 'latest').resolve()}" \
            if (out / "latest").is_symlink() else "; no checkpoint was saved"
        raise InputError(None, f"training diverged at step {step}: the {name} is {value} "
                         f"(try a lower --lr){kept}")


def _on_sigint(handler):
    """Ctrl-C finishes the current step and saves `latest`; a second one stops at once."""

    def first(signum, frame):
        handler()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    try:
        return signal.signal(signal.SIGINT, first)
    except ValueError:  # not the main thread: leave Ctrl-C alone
        return None
