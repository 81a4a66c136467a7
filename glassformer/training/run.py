"""One training run, set up and stepped: `Run` and `RunState`.

`Run.open` checks the run (prepare.py; nothing is written if it is refused), writes its token
file, builds the model and its optimizer, and restores a checkpoint when resuming. Then
`Run.step` takes one optimizer step at the schedule's rate, `Run.evaluate` measures, logs and
saves, and `Run.save` writes a checkpoint that a resume continues exactly. The loop that calls
them is loop.py.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..accel.fast_training import use_fast_training
from ..errors import InputError
from ..formats.checkpoint import save_to_run
from ..formats.peft import read_adapter
from ..generation.config import GenerationConfig
from ..generation.generate import generate
from ..generation.sampling import SamplingConfig
from ..model.encoder_decoder import EncoderDecoder, build_model
from ..model.transformer import Transformer
from . import distributed
from .batches import ChatBatches, TokenBatches
from .chat_data import ChatData, is_chat_data
from .config import TrainConfig
from .data import TokenData, write_token_file
from .lora import add_lora, load_adapter_tensors, save_adapter
from .metrics import MetricsLog
from .objectives import get_objective
from .optim import make_optimizer, set_learning_rate
from .prepare import prepare_run, remove_new_run
from .pretrained import base_name
from .schedule import learning_rate
from .step import autocast, evaluate, train_step


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
    def open(cls, data, out: Path, model_config, config: TrainConfig, resume: bool, process,
             announce=None) -> Run:
        """Checks the run (nothing written if it is refused), writes its token file, builds the
        model and optimizer, and restores a checkpoint when resuming."""
        sources, tokenizer, model_config, checkpoint, pretrained = prepare_run(
            data, out, model_config, config, resume, announce)
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
                remove_new_run(out, created)
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
        check_finite("validation loss", val_loss, state.step, self.out)
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


def check_finite(name: str, value: float, step: int, out: Path) -> None:
    """A diverged run stops before it logs or saves anything non-finite."""
    if not math.isfinite(value):
        kept = f"; the last good checkpoint is {(out / 'latest').resolve()}" \
            if (out / "latest").is_symlink() else "; no checkpoint was saved"
        raise InputError(None, f"training diverged at step {step}: the {name} is {value} "
                         f"(try a lower --lr){kept}")


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
