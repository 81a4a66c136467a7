"""The training loop, as a library function: `train(data, out_dir, model_config, train_config)`.

One optimizer step draws world_size · grad_accum · batch_size windows with the run's seeded
generator; each process takes its own slice, so the result does not depend on how many
processes share the work. AdamW (decay on matrices only) or Muon + AdamW (optim.py), warmup +
cosine, clipping, accumulation; evaluation on a fixed set of validation windows; checkpoints
that resume exactly.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from .batches import ChatBatches, TokenBatches
from .chat_data import ChatData, is_chat_data
from .config import TrainConfig, resume_conflicts
from .data import TokenData, iter_documents, list_sources, write_token_file
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
def evaluate(model, batches: TokenBatches | ChatBatches, batch_size: int, process, amp) -> float:
    """Mean validation loss per counted target over the run's validation set (this process's
    share of it, summed over every process)."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=process.device)  # (loss sum, targets)
    for batch in batches.validation(batch_size, process.device):
        with amp:
            totals[0] += batches.objective.loss(model, batch, reduction="sum").double()
        totals[1] += (batch[-1] != IGNORE).sum()  # the targets that count
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
        run = Run.open(data, Path(out_dir), model_config, config, resume, process)
        return _loop(run, progress, echo, threads, started)
    finally:
        distributed.teardown(process)


def _loop(run: Run, progress: bool, echo, threads: ThreadPolicy | None, started: float) -> dict:
    """Steps until max_iters (or max_time, or Ctrl-C), logging every log_interval steps and
    evaluating (and saving) every eval_interval steps and at the end."""
    config, state, main = run.config, run.state, run.process.is_main
    interrupted = []
    previous = _on_sigint(lambda: interrupted.append(True))
    bar = tqdm(total=config.max_iters, initial=state.step, disable=not (main and progress),
               unit="it", dynamic_ncols=True)
    loop_start, run_tokens, run_seconds = time.perf_counter(), 0, 0.0
    # a run resumed at an evaluated step logs (and evaluates) that step no second time
    train_loss, val_loss = math.nan, math.nan if state.val_loss is None else state.val_loss
    try:
        while state.step < config.max_iters and not interrupted:
            if config.max_time and time.perf_counter() - loop_start >= config.max_time:
                break
            if threads is not None:
                threads.revisit()  # other work on this CPU comes and goes
            t0 = time.perf_counter()
            lr, loss = run.step()
            seconds = time.perf_counter() - t0
            run_tokens, run_seconds = run_tokens + run.tokens_per_step, run_seconds + seconds
            state.train_seconds += seconds
            bar.update(1)
            if state.step % config.log_interval == 0 or state.step == config.max_iters:
                train_loss = distributed.all_reduce_sum(run.process, loss).item() / run.process.world_size
                _check_finite("training loss", train_loss, state.step, run.out)
                rate = run_tokens / max(run_seconds, 1e-9)
                bar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{rate:,.0f}", refresh=False)
                run.metrics.append({"iter": state.step, "train_loss": train_loss, "lr": lr,
                                    "tokens_seen": state.tokens_seen, "tokens_per_second": rate})
            if state.step % config.eval_interval == 0:
                val_loss = run.evaluate(train_loss, echo, started)
        if interrupted:
            run.save(("latest",))
        elif state.val_step != state.step:
            val_loss = run.evaluate(train_loss, echo, started)
    finally:
        bar.close()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if main and (run.out / "metrics.jsonl").is_file():
        plot_losses(run.out / "metrics.jsonl", run.out / "loss.png")
    if interrupted:
        raise KeyboardInterrupt
    distributed.barrier(run.process)  # no rank returns before rank 0 has saved the run
    out = run.out
    return {
        "iters": state.step, "tokens_seen": state.tokens_seen, "train_loss": train_loss,
        "val_loss": val_loss, "val_perplexity": math.exp(val_loss) if val_loss == val_loss else None,
        "best_val_loss": state.best_val_loss, "tokens_per_second": run_tokens / max(run_seconds, 1e-9),
        "wall_seconds": time.perf_counter() - started, "checkpoint": str(out / "latest"),
        "best_checkpoint": str(out / "best"), "metrics": str(out / "metrics.jsonl"),
        "loss_curve": str(out / "loss.png"), "world_size": run.process.world_size,
        "rank": run.process.rank,
        "trainable_parameters": sum(p.numel() for p in run.model.parameters() if p.requires_grad),
        "dtype": "bfloat16" if config.dtype == "bfloat16" and bf16_supported(run.process.device)
                 else "float32",
    }


@dataclass
class RunState:
    """Where a run stands, saved with each checkpoint so that a resume goes on from it."""

    step: int = 0
    tokens_seen: int = 0
    best_val_loss: float = math.inf
    train_seconds: float = 0.0
    val_step: int | None = None  # the last evaluated step, and its validation loss
    val_loss: float | None = None


@dataclass
class Run:
    """One training run, set up: the model (and `step_model`, the same model compiled or
    wrapped by DDP, which the steps and evaluations call), its optimizer, where its batches
    come from, the data generator and the state a checkpoint keeps."""

    out: Path
    config: TrainConfig
    process: distributed.Process
    model: Transformer | EncoderDecoder
    step_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    tokenizer: Any
    batches: TokenBatches | ChatBatches
    data_gen: torch.Generator
    state: RunState
    metrics: MetricsLog
    amp: Any

    @classmethod
    def open(cls, data, out: Path, model_config, config: TrainConfig, resume: bool, process) -> Run:
        """Checks the run (nothing written if it is refused), writes its token file, builds the
        model and optimizer, and restores a checkpoint when resuming."""
        sources, tokenizer, model_config, checkpoint, pretrained = _prepare(
            data, out, model_config, config, resume, process)
        T, main, device = model_config.context_length, process.is_main, process.device
        chat = ChatData.build(sources, tokenizer, T, config.val_fraction) if is_chat_data(sources) else None
        created = not out.exists()
        distributed.barrier(process)  # every rank has checked the run folder before rank 0 writes
        try:
            if main:
                out.mkdir(parents=True, exist_ok=True)
                if chat is None:
                    write_token_file(sources, tokenizer, out / "tokens.bin", config.documents)
            distributed.barrier(process)
            n_val = config.eval_iters * config.batch_size
            batches = ChatBatches(chat, n_val, process.rank, process.world_size) if chat else TokenBatches(
                TokenData.open(out / "tokens.bin", T, config.val_fraction), get_objective(config.objective),
                tokenizer, T, n_val, config.seed, process.rank, process.world_size)
            torch.manual_seed(config.seed)
            model = build_model(model_config)
            if pretrained is not None:
                model.load_state_dict(pretrained.state_dict(), strict=True)
                del pretrained
            model = use_fast_training(model.to(device))  # fused C++ passes on a CPU
            if config.lora is not None:  # the base frozen, adapters on its targets
                add_lora(model, config.lora)
            optimizer = make_optimizer(model, config)  # for the parameters that train
        except BaseException:
            if main and checkpoint is None:  # a refused fresh run leaves nothing behind
                _remove_new_run(out, created)
            raise
        data_gen, state = torch.Generator().manual_seed(config.seed), RunState()
        if checkpoint is not None:
            if config.lora is not None:  # the base came from config.init
                load_adapter_tensors(model, read_adapter(checkpoint.folder)[1], str(checkpoint.folder))
            else:
                checkpoint.load_weights(model, device)
            checkpoint.load_optimizer(optimizer)
            saved = checkpoint.training_state()
            data_gen.set_state(saved["rng.data"])
            torch.set_rng_state(saved["rng.torch"])
            state = RunState(**checkpoint.meta["state"])
        metrics = MetricsLog(out / "metrics.jsonl", enabled=main)
        metrics.truncate_after(state.step)  # a fresh run starts a fresh log
        step_model = torch.compile(model) if config.compile else model
        if process.world_size > 1:
            step_model = DistributedDataParallel(
                step_model, device_ids=[device.index] if device.type == "cuda" else None)
        return cls(out, config, process, model, step_model, optimizer, tokenizer, batches, data_gen,
                   state, metrics, autocast(device, config.dtype))

    @property
    def tokens_per_step(self) -> int:
        """Every process's windows of one optimizer step, in tokens."""
        windows = self.process.world_size * self.config.grad_accum * self.config.batch_size
        return windows * self.model.config.context_length

    def step(self) -> tuple[float, torch.Tensor]:
        """One optimizer step at the schedule's learning rate: (the rate, the loss)."""
        config, state = self.config, self.state
        lr = learning_rate(state.step, config.lr, config.min_lr, config.warmup_iters, config.decay_iters)
        set_learning_rate(self.optimizer, lr, config)
        n_local, process = config.grad_accum * config.batch_size, self.process
        mine = slice(process.rank * n_local, (process.rank + 1) * n_local)
        batch = self.batches.train(self.data_gen, process.world_size * n_local, mine, process.device)
        loss = train_step(self.step_model, self.optimizer, batch[0], batch[-1], config.grad_accum,
                          config.grad_clip, self.amp, self.batches.objective, batch)
        state.step += 1
        state.tokens_seen += self.tokens_per_step
        return lr, loss

    def evaluate(self, train_loss: float, echo, started: float) -> float:
        """The validation loss now, logged (with a sample of text) and saved: `latest`, and
        `best` when it is the lowest so far."""
        config, state, main = self.config, self.state, self.process.is_main
        val_loss = evaluate(self.step_model, self.batches, config.batch_size, self.process, self.amp)
        _check_finite("validation loss", val_loss, state.step, self.out)
        best = val_loss < state.best_val_loss
        state.best_val_loss = min(val_loss, state.best_val_loss)
        state.val_step, state.val_loss = state.step, val_loss
        record = {"iter": state.step, "val_loss": val_loss, "val_perplexity": math.exp(val_loss),
                  "train_loss": train_loss, "best": best, "elapsed": time.perf_counter() - started}
        if main and config.sample_tokens and self.model.config.causal:  # an encoder writes no text
            record["sample"] = sample_text(self.model, self.tokenizer, config.sample_tokens,
                                           seed=config.seed + state.step)
        self.metrics.append(record)
        if main:
            echo(f"step {state.step}: val loss {val_loss:.4f} (perplexity "
                 f"{math.exp(val_loss):.2f}){' best' if best else ''}")
            if record.get("sample"):
                echo(record["sample"])
        self.save(("latest", "best") if best else ("latest",))
        return val_loss

    def save(self, links: tuple[str, ...]) -> None:
        """A checkpoint of this step (rank 0 writes it), linked as `links`."""
        if not self.process.is_main:
            return
        config = self.config
        meta = {"train": config.to_dict(), "state": dataclasses.asdict(self.state)}
        rng = {"rng.data": self.data_gen.get_state(), "rng.torch": torch.get_rng_state()}
        adapter = None if config.lora is None else (
            lambda folder: save_adapter(folder, self.model, config.lora, base_name(config.init)))
        save_to_run(self.out, self.state.step, links, self.model, self.tokenizer, meta, self.optimizer,
                    rng, adapter)


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
