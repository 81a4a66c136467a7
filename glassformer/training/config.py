"""TrainConfig: every training choice (optimizer, schedule, budgets, data), and named recipes."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from ..errors import InputError
from ..model.config import ConfigFields, ModelConfig, check_finite
from .lora import LoRAConfig

# Fields a resumed run may change: budgets and observation, never the math of a step.
RESUMABLE_CHANGES = frozenset(
    {"max_iters", "max_time", "eval_interval", "eval_iters", "log_interval", "sample_tokens",
     "compile", "device"}
)


@dataclass(frozen=True)
class TrainConfig(ConfigFields):
    batch_size: int = 12  # sequences per micro-batch on each process
    grad_accum: int = 1  # micro-batches per optimizer step
    max_iters: int = 2000  # optimizer steps
    max_time: float | None = None  # seconds of training; stops early, saving a checkpoint
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int | None = None  # None: max_iters
    weight_decay: float = 0.1  # on matrices (≥ 2-D parameters) only
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: Muon for the blocks' matrices
    muon_lr: float = 0.02  # Muon's peak rate (the schedule scales it like lr)
    muon_momentum: float = 0.95
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0: no clipping
    eval_interval: int = 250
    eval_iters: int = 20  # fixed validation batches, the same at every evaluation
    log_interval: int = 10
    sample_tokens: int = 200  # printed at each evaluation; 0: none
    val_fraction: float = 0.1
    seed: int = 1337
    dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16: autocast where supported
    compile: bool = False
    tokenizer: Literal["char", "bpe"] = "char"
    vocab_size: int | None = None  # for bpe
    documents: Literal["file", "line", "blank"] = "file"
    device: str = "auto"  # auto: cuda when present, else cpu
    objective: Literal["clm", "span", "mlm"] = "clm"  # span: T5's span corruption (encoder-decoders);
    # mlm: BERT's masked LM (encoders)
    init: str | None = None  # start from this pretrained model (what glassformer.load reads):
    # its config, weights and tokenizer (training/pretrained.py)
    lora_rank: int | None = None  # LoRA (training/lora.py): rank-r adapters on the frozen --init
    # model, r at most min(in, out) of each target; None: every weight trains (the other lora_
    # fields are then refused unless at their defaults)
    lora_alpha: float = 16.0  # the updates are scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the adapters' input
    lora_targets: str = "q,k,v,o,gate,up,down"  # comma-separated projections of each block

    def __post_init__(self) -> None:
        check_finite(self)
        for name in ("batch_size", "grad_accum", "max_iters", "eval_interval", "eval_iters",
                     "log_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InputError(name, f"must be a positive integer, got {value!r}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip", "warmup_iters", "sample_tokens"):
            if getattr(self, name) < 0:
                raise InputError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.min_lr > self.lr:
            raise InputError("min_lr", f"{self.min_lr} is above lr={self.lr}")
        if self.optimizer not in ("adamw", "muon"):
            raise InputError("optimizer", f"choose adamw or muon, got {self.optimizer!r}")
        if self.muon_lr < 0:
            raise InputError("muon_lr", f"must be >= 0, got {self.muon_lr}")
        for name in ("beta1", "beta2", "muon_momentum"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise InputError(name, f"must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 < self.val_fraction < 1.0:
            raise InputError("val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        if self.max_time is not None and self.max_time <= 0:
            raise InputError("max_time", f"must be positive, got {self.max_time}")
        if self.dtype not in ("float32", "bfloat16"):
            raise InputError("dtype", f"choose float32 or bfloat16, got {self.dtype!r}")
        if self.tokenizer not in ("char", "bpe"):
            raise InputError("tokenizer", f"choose char or bpe, got {self.tokenizer!r}")
        if self.tokenizer == "bpe" and self.vocab_size is None:
            raise InputError("vocab_size", "a bpe tokenizer needs --vocab-size")
        if self.objective not in ("clm", "span", "mlm"):
            raise InputError("objective", f"choose clm, span or mlm, got {self.objective!r}")
        if self.init is not None and (not isinstance(self.init, str) or not self.init):
            raise InputError("init", f"expected a model name or path, got {self.init!r}")
        if self.lora is not None and self.init is None:
            raise InputError("lora_rank", "LoRA adapts a pretrained model; give --init")
        if self.lora_rank is None:  # never a full fine-tune when LoRA was asked
            for field in fields(self):
                name = field.name
                if name.startswith("lora_") and getattr(self, name) != field.default:
                    raise InputError(name, f"--{name.replace('_', '-')} applies to LoRA: give "
                                     "--lora-rank too")
        if self.documents not in ("file", "line", "blank"):
            raise InputError("documents", f"choose file, line or blank, got {self.documents!r}")

    @property
    def lora(self) -> LoRAConfig | None:
        """The LoRA settings (validated), or None for full training."""
        if self.lora_rank is None:
            return None
        targets = tuple(t.strip() for t in self.lora_targets.split(","))
        return LoRAConfig(self.lora_rank, self.lora_alpha, self.lora_dropout, targets)

    @property
    def decay_iters(self) -> int:
        return self.max_iters if self.lr_decay_iters is None else self.lr_decay_iters



@dataclass(frozen=True)
class Recipe:
    """A named model + training pair. The model's vocab_size is replaced by the tokenizer's."""

    model: ModelConfig
    train: TrainConfig
    description: str


# nanoGPT's documented CPU recipe for shakespeare_char (bias=False: no biases anywhere).
_NANOGPT_CHAR = ModelConfig(
    vocab_size=65, context_length=64, d_model=128, n_layers=4, n_heads=4, position="learned",
    norm="layernorm", norm_bias=False, activation="gelu", attn_bias=False, attn_out_bias=False,
    mlp_bias=False,
    tie_embeddings=True, dropout=0.0,
)

RECIPES: dict[str, Recipe] = {
    "shakespeare-char": Recipe(
        _NANOGPT_CHAR,
        TrainConfig(batch_size=12, max_iters=2000, lr=1e-3, min_lr=1e-4, warmup_iters=100,
                    weight_decay=0.1, beta2=0.99, grad_clip=1.0, eval_interval=250, eval_iters=20),
        "nanoGPT's CPU recipe: 4 layers, 4 heads, d 128, context 64, batch 12, 2000 iterations",
    ),
    # nanoGPT's GPU recipe (its config/train_shakespeare_char.py on train.py's defaults): bfloat16
    # where the device computes it, and compiled.
    "shakespeare-char-gpu": Recipe(
        _NANOGPT_CHAR.replace(context_length=256, d_model=384, n_layers=6, n_heads=6, dropout=0.2),
        TrainConfig(batch_size=64, max_iters=5000, lr=1e-3, min_lr=1e-4, warmup_iters=100,
                    weight_decay=0.1, beta2=0.99, grad_clip=1.0, eval_interval=250, eval_iters=200,
                    dtype="bfloat16", compile=True),
        "nanoGPT's GPU recipe: 6 layers, 6 heads, d 384, context 256, batch 64, dropout 0.2, "
        "5000 iterations, bfloat16, compiled",
    ),
    # Same depth and width, more learnt per step: rotary positions (no position table to
    # learn), RMSNorm, a SwiGLU feed-forward (d_ff 336: the plain MLP's weight count), Muon for
    # the blocks' matrices (AdamW, at a 4x higher peak with beta2 0.95, for the rest) and a
    # short warmup. Reaches the recipe's 2000-iteration validation loss in about 450
    # iterations (the final loss varies by about 0.02 with the seed or small changes of rate:
    # 500 leaves room).
    "shakespeare-char-fast": Recipe(
        _NANOGPT_CHAR.replace(position="rope", norm="rmsnorm", activation="silu", gated=True,
                              d_ff=336),
        TrainConfig(batch_size=12, max_iters=500, lr=4e-3, min_lr=1e-4, warmup_iters=30,
                    weight_decay=0.1, beta2=0.95, grad_clip=1.0, optimizer="muon", muon_lr=0.03,
                    eval_interval=250, eval_iters=20, sample_tokens=100),
        "shakespeare-char with rotary positions, RMSNorm, SwiGLU, Muon and a short, hot "
        "schedule: 500 iterations",
    ),
    # The GPU recipe's size, data per step and dropout, made to reach a validation loss of 1.47
    # in as little wall time as possible on one GPU (benchmarks/gpu_time_to_loss.py times it
    # against nanoGPT compiled):
    # - rotary positions, RMSNorm and SwiGLU (d_ff 1024: the plain MLP's 3·d·4d weights in
    #   three matrices), as shakespeare-char-fast: fewer steps to the same loss;
    # - Muon for the blocks' matrices (orthogonalized updates, the Newton–Schulz iterations in
    #   bfloat16, same-shaped matrices batched into one product), AdamW at a 4x higher peak and
    #   beta2 0.95 for the embeddings, the tied head and the gains;
    # - a short warmup and one 1000-step cosine: the rate is annealed by the time the target is
    #   due, and a run that reaches it sooner stops there;
    # - dropout 0.2 as nanoGPT: at 16k tokens a step the run sees the million training characters
    #   many times over, and the target is a validation loss;
    # - bfloat16 autocast and torch.compile: the products on the tensor cores, the rest fused;
    # - evaluations every 100 steps over 50 fixed batches (3,200 windows, every validation
    #   character about 7 times) and no text sample: the target is seen within 100 steps of
    #   being reached, at a small cost per look.
    # The fused C++ training passes (accel/fast_training.py) are a CPU's; on a GPU the compiled
    # modules take their place.
    "shakespeare-char-gpu-fast": Recipe(
        _NANOGPT_CHAR.replace(context_length=256, d_model=384, n_layers=6, n_heads=6, dropout=0.2,
                              position="rope", norm="rmsnorm", activation="silu", gated=True,
                              d_ff=1024),
        TrainConfig(batch_size=64, max_iters=1000, lr=4e-3, min_lr=1e-4, warmup_iters=30,
                    weight_decay=0.1, beta2=0.95, grad_clip=1.0, optimizer="muon", muon_lr=0.02,
                    eval_interval=100, eval_iters=50, sample_tokens=0, dtype="bfloat16",
                    compile=True),
        "shakespeare-char-gpu's size with rotary positions, RMSNorm, SwiGLU, Muon and one "
        "1000-step schedule, bfloat16, compiled: aimed at validation loss 1.47 in half "
        "nanoGPT's time",
    ),
}


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise InputError(None, f"unknown preset {name!r}; known: {', '.join(sorted(RECIPES))}") from None


def resume_conflicts(saved: TrainConfig, asked: TrainConfig) -> list[str]:
    """Fields that differ between a saved run and the resumed one, budgets excepted. A
    derived setting left unset (lr_decay_iters: None) follows the new budget; one set
    explicitly must equal what the saved run used."""
    a, b = saved.to_dict(), asked.to_dict()
    a["lr_decay_iters"] = saved.decay_iters
    if saved.lr_decay_iters is not None or asked.lr_decay_iters is not None:
        b["lr_decay_iters"] = asked.decay_iters
    else:
        b["lr_decay_iters"] = a["lr_decay_iters"]
    return [f"{k}={b[k]!r} (saved {a[k]!r})" for k in a if k not in RESUMABLE_CHANGES and a[k] != b[k]]
