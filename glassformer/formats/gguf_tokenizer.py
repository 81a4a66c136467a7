"""A GGUF file's tokenizer, rebuilt from its `tokenizer.ggml.*` metadata as llama.cpp reads it.

Kinds (`tokenizer.ggml.model`):
- `gpt2`: byte-level BPE. `tokenizer.ggml.pre` names how text is cut before the merges run:
  PRE_SPLITS holds, per name, regular expressions applied in turn (each cuts every piece into
  its matches and the text between them), then GPT-2's byte-to-character map. Merges come from
  `tokenizer.ggml.merges`; with `ignore_merges` (Llama 3) a piece that is a token is taken whole.
- `llama`: SentencePiece. Spaces become ▁ (and one more leads the text with
  `add_space_prefix`, llama.cpp's default), then the adjacent pair whose joined text is the
  highest-scoring token merges first, until none does; a piece left outside the vocabulary is
  spelled in its bytes (`<0xNN>` tokens), or is the unknown token where there are none. The
  scores become BPE merges once (`score_merges`): every cut of a token into two tokens, ranked
  by the whole token's score.
- `gemma4`: BPE over raw UTF-8 (no byte map), spaces written ▁, cut at newlines only.
Any other kind, or a pre-tokenizer name not in PRE_SPLITS, is refused by name.

Control and user-defined tokens are matched in the text before anything else. BOS follows
llama.cpp: added by default for SentencePiece and Llama-3-style BPE, and as
`tokenizer.ggml.add_bos_token` says where the file says. The end-of-generation ids are EOS,
`eot` / `eom`, and every token whose text is one of END_OF_TURN_TEXTS, which llama.cpp also
matches in text as control tokens whatever the file calls them (Qwen2's `</s>`).
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from ..errors import InputError
from .chat_tokenizer import ChatTokenizer

# tokenizer.ggml.token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # ▁, SentencePiece's written space
# llama.cpp ends a reply at any token of these texts and makes it a control token, whatever its type
END_OF_TURN_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                     "<|endoftext|>", "<|end_of_text|>", "<EOT>", "<eos>", "<turn|>", "</s>")

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2)
_HAN_HANGUL = r"[一-龥ࠀ-一가-퟿]+"
_LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "dbrx", "smaug-bpe")

# tokenizer.ggml.pre -> the regular expressions that cut text before byte-level BPE, in turn
PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais"), (_GPT2,)),
    **dict.fromkeys(_LLAMA3_NAMES, (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), (_QWEN2,)),
    "qwen35": (_QWEN35,),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                     "minerva-7b"), _DIGITS_THEN_GPT2),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _HAN_HANGUL, r"\p{N}"),
    "deepseek-llm": (r"[\r\n]", r"\s?[\p{Lu}\p{Ll}\p{Lt}]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
                     r"\s+$", _HAN_HANGUL, r"\p{N}+"),
}
_NFC = ("qwen2", "deepseek-r1-qwen")  # the original tokenizer.json normalizes to NFC first


def from_gguf_metadata(meta: dict[str, Any]) -> ChatTokenizer:
    """The tokenizer `tokenizer.ggml.*` describes, with its BOS rule, end ids and chat template."""
    kind = meta.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level, "llama": _sentencepiece, "gemma4": _gemma4}
    if kind not in builders:
        raise InputError(None, f"unsupported GGUF tokenizer {kind!r} (supported: "
                         f"{', '.join(builders)})")
    tokens = _list(meta, "tokenizer.ggml.tokens", str)
    if not tokens:
        raise InputError(None, "GGUF lacks its vocabulary (tokenizer.ggml.tokens)")
    types = _list(meta, "tokenizer.ggml.token_type", int, len(tokens)) or [NORMAL] * len(tokens)
    types = [CONTROL if t in END_OF_TURN_TEXTS else kind for t, kind in zip(tokens, types, strict=True)]
    tokenizer, add_bos = builders[kind](meta, tokens, types)
    specials = [AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
                for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)]
    tokenizer.add_tokens(specials)
    ids = {key: _token_id(meta, key, len(tokens))
           for key in ("bos", "eos", "eot", "eom", "padding", "unknown")}
    ends = {i for key in ("eos", "eot", "eom") if (i := ids[key]) is not None}
    ends |= {i for i, t in enumerate(tokens) if t in END_OF_TURN_TEXTS}
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise InputError(None, "GGUF tokenizer.chat_template: expected a string")
    add_bos = meta.get("tokenizer.ggml.add_bos_token", add_bos)

    def text(i: int | None) -> str | None:
        return None if i is None else tokens[i]

    return ChatTokenizer(tokenizer, text(ids["eos"]), text(ids["bos"]), template, bool(add_bos),
                         end_ids=tuple(sorted(ends)), specials={
                             name: tokens[ids[key]] for name, key in
                             (("pad_token", "padding"), ("unk_token", "unknown")) if ids[key] is not None})


def _byte_level(meta: dict, tokens: list[str], types: list[int]) -> tuple[Tokenizer, bool]:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        raise InputError(None, f"unsupported GGUF pre-tokenizer {pre!r}; supported: "
                         f"{', '.join(sorted(PRE_SPLITS))}")
    llama3 = pre in _LLAMA3_NAMES
    vocab = _vocab(tokens)
    tokenizer = Tokenizer(models.BPE(vocab, _merges(meta, vocab), fuse_unk=False,
                                     ignore_merges=llama3))
    if pre in _NFC:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = byte_level_splits(pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, llama3


def byte_level_splits(pre: str) -> pre_tokenizers.PreTokenizer:
    """PRE_SPLITS[pre]'s cuts in turn, then GPT-2's byte-to-character map."""
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def pre_name(pre_tokenizer: dict) -> str | None:
    """The GGUF name of a tokenizer.json's pre-tokenizer built by byte_level_splits, if any."""
    for name in PRE_SPLITS:
        if json.loads(_serialized(name)) == pre_tokenizer:
            return name
    return None


def _serialized(pre: str) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = byte_level_splits(pre)
    return json.dumps(json.loads(tokenizer.to_str())["pre_tokenizer"])


def _gemma4(meta: dict, tokens: list[str], types: list[int]) -> tuple[Tokenizer, bool]:
    vocab = _vocab(tokens)
    tokenizer = Tokenizer(models.BPE(vocab, _merges(meta, vocab), fuse_unk=False,
                                     byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    tokenizer.decoder = _spaces_decoder(strip=False)
    return tokenizer, True


def _sentencepiece(meta: dict, tokens: list[str], types: list[int]) -> tuple[Tokenizer, bool]:
    scores = _list(meta, "tokenizer.ggml.scores", (int, float), len(tokens))
    if not scores:
        raise InputError(None, "GGUF SentencePiece vocabulary lacks tokenizer.ggml.scores")
    unk = _token_id(meta, "unknown", len(tokens))
    has_bytes = any(t == BYTE for t in types)
    vocab = _vocab(tokens)
    tokenizer = Tokenizer(models.BPE(
        vocab, score_merges(tokens, scores, types, vocab), byte_fallback=has_bytes,
        unk_token=None if unk is None else tokens[unk], fuse_unk=False))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    spaces = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = (normalizers.Sequence([normalizers.Prepend(SPACE), spaces])
                            if prefix else spaces)
    tokenizer.decoder = _spaces_decoder(strip=bool(prefix))
    return tokenizer, True


def score_merges(tokens: list[str], scores: list[float], types: list[int],
                 vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece's scores as BPE merges: each cut of a token into two tokens, the cuts of
    higher-scoring tokens first (ties: the lower id). `vocab`: token -> id."""
    ranked = sorted((i for i, t in enumerate(types) if t in (NORMAL, USER_DEFINED, UNUSED)),
                    key=lambda i: (-scores[i], i))
    merges = []
    for i in ranked:
        token = tokens[i]
        merges += [(token[:k], token[k:]) for k in range(1, len(token))
                   if token[:k] in vocab and token[k:] in vocab]
    return merges


def _spaces_decoder(strip: bool) -> decoders.Decoder:
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip else []))


def _vocab(tokens: list[str]) -> dict[str, int]:
    return {token: i for i, token in enumerate(tokens)}


def _merges(meta: dict, vocab: dict[str, int]) -> list[tuple[str, str]]:
    merges = _list(meta, "tokenizer.ggml.merges", str)
    if not all(" " in m for m in merges):
        raise InputError(None, "GGUF tokenizer.ggml.merges: expected strings of two tokens")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    for a, b in pairs:  # the tokenizers library panics on a merge outside the vocabulary
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise InputError(None, f"GGUF tokenizer.ggml.merges: {a!r} + {b!r} is not in the vocabulary")
    return pairs


def _list(meta: dict, key: str, kind, length: int | None = None) -> list:
    """The metadata array `key` (empty when absent), each item a `kind`, `length` items long."""
    value = meta.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
        raise InputError(None, f"GGUF {key}: expected a list of {getattr(kind, '__name__', 'numbers')}")
    if value and length is not None and len(value) != length:
        raise InputError(None, f"GGUF {key}: {len(value)} entries for {length} tokens")
    return value


def _token_id(meta: dict, key: str, n_tokens: int) -> int | None:
    """`tokenizer.ggml.<key>_token_id`, checked to lie in the vocabulary (None when absent)."""
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    if i is not None and not (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_tokens):
        raise InputError(None, f"GGUF tokenizer.ggml.{key}_token_id = {i!r} is outside the "
                         f"vocabulary of {n_tokens} tokens")
    return i
