"""The tokenizer of a pretrained model: an HFTokenizer plus whether to add BOS, the tokens that
end a reply, and a chat template.

Built from a GGUF vocabulary (gguf_tokenizer.py) or read from a Hugging Face folder
(`tokenizer.json` + `tokenizer_config.json` + `generation_config.json`); saved in the Hugging
Face layout so both `transformers` and `ChatTokenizer.load` read it back.

BOS, as transformers adds it: whatever tokenizer.json's post-processor puts before the text
(Gemma's and Llama 3's add their BOS there), unless `tokenizer_config.json` names a model's own
tokenizer class and writes `add_bos_token` (that class rebuilds its post-processor from it).
Saved, a tokenizer that adds BOS gets a post-processor that does, so transformers agrees.
The ids that end a reply: EOS, and every id of `generation_config.json`'s `eos_token_id`
(Llama 3's `<|eot_id|>`, Gemma's `<end_of_turn>`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from tokenizers import Tokenizer, processors

from ..errors import InputError
from .files import read_json_object
from .tokenizers import HFTokenizer, read_tokenizer, token_text

GENERIC_CLASS = "PreTrainedTokenizerFast"  # transformers reads its BOS from the post-processor alone
# Special tokens tokenizer_config.json may name besides BOS and EOS, which transformers reads
# (pad_token: batches, unk_token): kept as read, written back on save.
OTHER_SPECIALS = ("pad_token", "unk_token")
TEMPLATE_SECONDS = 2.0  # a chat template renders in milliseconds; a loop that does not stops here
TEMPLATE_MIN_OUTPUT = 1 << 20  # characters; or four times the messages' text where that is more


class ChatTokenizer(HFTokenizer):
    """An HFTokenizer that also knows whether to prepend BOS, the ids that end a reply
    (`end_ids`: EOS and any end-of-turn token) and the model's chat template."""

    def __init__(self, tokenizer: Tokenizer, eos_token: str | None = None,
                 bos_token: str | None = None, chat_template: str | None = None,
                 add_bos: bool = False, end_ids: tuple[int, ...] = (),
                 specials: dict[str, str] | None = None):
        super().__init__(tokenizer, eos_token, bos_token)
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.specials = dict(specials or {})  # OTHER_SPECIALS the files name, kept for an export
        size = self.vocab_size
        for i in end_ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < size:
                raise InputError("eos_token_id", f"{i!r} is not a token id (vocabulary of {size})")
        self._end_ids = frozenset(end_ids) | super().end_ids

    @property
    def end_ids(self) -> frozenset[int]:
        return self._end_ids

    def encode(self, text: str) -> list[int]:
        """The text's ids, after BOS where the tokenizer adds one and the text does not begin
        with it already (never twice)."""
        ids = super().encode(text)
        if not self.add_bos or self.bos_id is None or ids[:1] == [self.bos_id]:
            return ids
        return [self.bos_id, *ids]

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
        tokenizer = self.tokenizer
        if self.add_bos and self.bos_id not in _leading_specials(tokenizer):  # as transformers reads it
            tokenizer = Tokenizer.from_str(tokenizer.to_str())
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{self.bos_token} $A", pair=f"{self.bos_token} $A {self.bos_token} $B",
                special_tokens=[(self.bos_token, self.bos_id)])
        tokenizer.save(str(path))
        config: dict[str, Any] = {"tokenizer_class": GENERIC_CLASS,
                                  "bos_token": self.bos_token, "eos_token": self.eos_token,
                                  "add_bos_token": self.add_bos, **self.specials}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        path.with_name("tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        ends = sorted(self.end_ids)
        if ends != sorted(HFTokenizer.end_ids.fget(self)):  # more than EOS ends a reply
            generation = path.with_name("generation_config.json")
            settings = read_json_object(generation) if generation.is_file() else {}
            generation.write_text(json.dumps(settings | {"eos_token_id": ends}, indent=2) + "\n")

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
        tokenizer = read_tokenizer(path)
        bos_token = token_text(config.get("bos_token"))
        leading = _leading_specials(tokenizer)
        if bos_token is None and len(leading) == 1:
            bos_token = tokenizer.id_to_token(leading[0])
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool) or config.get("tokenizer_class") == GENERIC_CLASS:
            add_bos = bos_token is not None and tokenizer.token_to_id(bos_token) in leading
        generation = path.with_name("generation_config.json")
        ends = read_json_object(generation).get("eos_token_id") if generation.is_file() else None
        ends = [ends] if isinstance(ends, int) else ends if isinstance(ends, list) else []
        specials = {name: token_text(config[name]) for name in OTHER_SPECIALS
                    if isinstance(token_text(config.get(name)), str)}
        return cls(tokenizer, token_text(config.get("eos_token")), bos_token, template, add_bos,
                   tuple(ends), specials)


def _leading_specials(tokenizer: Tokenizer) -> list[int]:
    """The ids a tokenizer.json's post-processor puts before a text (BOS, or BERT's [CLS])."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    whole = tokenizer.encode("a", add_special_tokens=True).ids
    starts = [k for k in range(len(whole) - len(plain) + 1) if whole[k:k + len(plain)] == plain]
    return whole[:starts[0]] if starts else []


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
