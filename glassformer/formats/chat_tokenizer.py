"""The tokenizer of a pretrained model: an HFTokenizer plus whether to add BOS and a chat template.

Built from a GGUF vocabulary (`from_gguf_metadata`) or read from a Hugging Face folder
(`tokenizer.json` + `tokenizer_config.json`); saved in the Hugging Face layout so both
`transformers` and `ChatTokenizer.load` read it back.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from ..errors import InputError
from .files import read_json_object
from .tokenizers import HFTokenizer, read_tokenizer, token_text

TEMPLATE_SECONDS = 2.0  # a chat template renders in milliseconds; a loop that does not stops here
TEMPLATE_MIN_OUTPUT = 1 << 20  # characters; or four times the messages' text where that is more
# GGUF tokenizer.ggml.token_type values
_CONTROL, _USER_DEFINED = 3, 4


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2()]
    )


def _qwen2() -> pre_tokenizers.PreTokenizer:
    """Qwen2's split (single digits, letters with one leading mark, newline runs), then bytes."""
    split = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
             r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# GGUF tokenizer.ggml.pre -> the pre-tokenizer of the original tokenizer.json
PRE_TOKENIZERS = {
    "default": _gpt2,
    "gpt-2": _gpt2,
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "qwen2": _qwen2,
}
# ... and the normalizer before it, where the original has one
NORMALIZERS = {"qwen2": normalizers.NFC}


# Special tokens tokenizer_config.json may name besides BOS and EOS, which transformers reads
# (pad_token: batches, unk_token): kept as read, written back on save.
OTHER_SPECIALS = ("pad_token", "unk_token")


class ChatTokenizer(HFTokenizer):
    """An HFTokenizer that also knows whether to prepend BOS and the model's chat template."""

    def __init__(self, tokenizer: Tokenizer, eos_token: str | None = None,
                 bos_token: str | None = None, chat_template: str | None = None,
                 add_bos: bool = False, specials: dict[str, str] | None = None):
        super().__init__(tokenizer, eos_token, bos_token)
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.specials = dict(specials or {})  # OTHER_SPECIALS the files name, kept for an export

    def encode(self, text: str) -> list[int]:
        ids = super().encode(text)
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as text, through the model's own Jinja chat template."""
        if not self.chat_template:
            raise InputError(None, "this model has no chat template")
        size = sum(len(str(m.get("content", ""))) for m in messages)
        return render_template(self.chat_template, max(TEMPLATE_MIN_OUTPUT, 4 * size),
                               messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation (the template writes any BOS itself)."""
        return super().encode(self.render_chat(messages, add_generation_prompt))

    def save(self, path: str | Path) -> None:
        """tokenizer.json at `path` and tokenizer_config.json beside it (Hugging Face layout)."""
        path = Path(path)
        super().save(path)
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "bos_token": self.bos_token, "eos_token": self.eos_token,
                                  "add_bos_token": self.add_bos, **self.specials}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        path.with_name("tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ChatTokenizer:
        """From a tokenizer.json (or the folder holding it) and its tokenizer_config.json."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        side = path.with_name("tokenizer_config.json")
        config = read_json_object(side) if side.is_file() else {}
        template = config.get("chat_template")
        if not isinstance(template, str):  # a list of named templates is not supported
            template = None
        specials = {name: token_text(config[name]) for name in OTHER_SPECIALS
                    if isinstance(token_text(config.get(name)), str)}
        return cls(read_tokenizer(path), token_text(config.get("eos_token")),
                   token_text(config.get("bos_token")), template,
                   bool(config.get("add_bos_token", False)), specials)


def from_gguf_metadata(meta: dict[str, Any]) -> ChatTokenizer:
    """Rebuild a byte-level BPE tokenizer from `tokenizer.ggml.*` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise InputError(None, f"unsupported GGUF tokenizer {kind!r} (supported: byte-level BPE 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise InputError(None, f"unsupported GGUF pre-tokenizer {pre!r}; supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise InputError(None, "GGUF lacks its vocabulary (tokenizer.ggml.tokens)")
    if not all(isinstance(t, str) for t in tokens):
        raise InputError(None, "GGUF tokenizer.ggml.tokens: expected a list of strings")
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if not isinstance(types, list) or len(types) != len(tokens):
        raise InputError(None,
                         f"GGUF tokenizer.ggml.token_type: {len(types) if isinstance(types, list) else 0} "
                         f"entries for {len(tokens)} tokens")
    merges = meta.get("tokenizer.ggml.merges", [])
    if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
        raise InputError(None, "GGUF tokenizer.ggml.merges: expected strings of two tokens")
    merges = [tuple(m.split(" ", 1)) for m in merges]
    vocab = {token: i for i, token in enumerate(tokens)}
    for a, b in merges:  # the tokenizers library panics on a merge outside the vocabulary
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise InputError(None, f"GGUF tokenizer.ggml.merges: {a!r} + {b!r} is not in the vocabulary")
    for key in ("eos", "bos"):  # an end-of-text id outside the vocabulary never stops a reply
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and not (isinstance(i, int) and 0 <= i < len(tokens)):
            raise InputError(None, f"GGUF tokenizer.ggml.{key}_token_id = {i!r} is outside the "
                             f"vocabulary of {len(tokens)} tokens")
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=False))
    if pre in NORMALIZERS:
        tokenizer.normalizer = NORMALIZERS[pre]()
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
                          for i in range(len(tokens)) if types[i] in (_CONTROL, _USER_DEFINED)])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise InputError(None, "GGUF tokenizer.chat_template: expected a string")
    return ChatTokenizer(tokenizer, token("eos"), token("bos"), template,
                         bool(meta.get("tokenizer.ggml.add_bos_token", False)))


def _raise(message: str) -> None:
    raise InputError(None, f"chat template: {message}")


class _Limits(ImmutableSandboxedEnvironment):
    """The sandbox, with a deadline checked on every loop over range() and on every call and
    attribute read, and with string and list repetition (`*`) bounded."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, deadline: float, max_chars: int):
        super().__init__(trim_blocks=True, lstrip_blocks=True)
        self.deadline, self.max_chars = deadline, max_chars
        self.globals.update(raise_exception=_raise, range=self._range)

    def _tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise InputError(None, f"chat template: rendering took over {TEMPLATE_SECONDS:g} s")

    def _range(self, *args: int):
        for i, value in enumerate(range(*args)):
            if i % 1024 == 0:
                self._tick()
            yield value

    def call(self, context, obj, *args, **kwargs):
        self._tick()
        return super().call(context, obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        self._tick()
        return super().getattr(obj, attribute)

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise InputError(None, f"chat template: exponent {right} is too large")
        if operator == "*":
            size = max(len(v) if isinstance(v, (str, list, tuple)) else 1 for v in (left, right))
            count = max(v if isinstance(v, int) else 1 for v in (left, right))
            if size * count > self.max_chars:
                raise InputError(None, f"chat template: output over {self.max_chars} characters")
        return super().call_binop(context, operator, left, right)


def render_template(template: str, max_chars: int, **values: Any) -> str:
    """A Jinja chat template rendered in the sandbox under a time and output-size limit; any
    error in the template (syntax, unsafe access, undefined name) is one ValueError."""
    env = _Limits(time.monotonic() + TEMPLATE_SECONDS, max_chars)
    try:
        pieces, size = [], 0
        for piece in env.from_string(template).generate(**values):
            size += len(piece)
            if size > max_chars:
                raise InputError(None, f"chat template: output over {max_chars} characters")
            env._tick()
            pieces.append(piece)
        return "".join(pieces)
    except TemplateSyntaxError as error:
        raise InputError("chat template",
                         f"syntax error on line {error.lineno}: {error.message}") from None
    except SecurityError as error:
        raise InputError(None, f"chat template: unsafe operation refused ({error})") from None
    except (TemplateError, TypeError, AttributeError, KeyError, IndexError, ZeroDivisionError,
            OverflowError, RecursionError) as error:
        raise InputError(None, f"chat template: {type(error).__name__}: {error}") from None
