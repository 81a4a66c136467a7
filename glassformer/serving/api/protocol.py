"""The OpenAI API's request and response shapes as pydantic models: validation and its error
messages come from these schemas, not from checks written by hand in the routes."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from ...errors import InputError
from ...generation.config import kept_in_step
from ...generation.sampling import SamplingConfig
from ...model.sites import Site
from .. import RequestParams

MAX_CHOICES = 16  # the most choices (n) and candidates (best_of) one request may ask for
Choices = Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)]


class Strict(BaseModel):
    """Unknown fields are rejected (OpenAI answers them with 400 too); no silent coercion of
    strings to numbers or numbers to booleans."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: StrictBool = False


class SteerField(Strict):
    """α × a named steering vector added at a site (the vector's own by default)."""

    vector: str = Field(min_length=1)
    site: str | None = None
    alpha: Annotated[float, Field(allow_inf_nan=False)]


class LensField(Strict):
    top_k: Annotated[StrictInt, Field(ge=1, le=20)] = 5
    # the residuals read (i: after i blocks, 0 the embedding's output); None: every one
    layers: Annotated[list[Annotated[StrictInt, Field(ge=0)]],
                      Field(min_length=1, max_length=1024)] | None = None


class Glassformer(Strict):
    """Settings beyond OpenAI's, under the request's `glassformer` key."""

    ignore_eos: StrictBool = False
    trace: Annotated[list[str], Field(max_length=8)] = []  # hook sites returned for this request
    ui: StrictBool = False  # watched on the live page (/ui): captures its residuals, queries and keys
    steer: Annotated[list[SteerField], Field(max_length=8)] = []  # for this request's rows only
    ablate: Annotated[list[str], Field(max_length=64)] = []  # heads zeroed: blocks.3.attn.head.2
    lens: LensField | None = None  # each layer's top-k tokens per position, returned at the end


class SteeringVectorUpload(Strict):
    """POST /v1/steering_vectors: a vector for the served model, under a name requests use."""

    model: str = Field(min_length=1)
    name: str = Field(min_length=1, max_length=64)
    site: str = Field(min_length=1)
    vector: Annotated[list[Annotated[float, Field(allow_inf_nan=False)]],
                      Field(min_length=1, max_length=65536)]


class SamplingFields(Strict):
    """The fields completions and chat share."""

    model: str = Field(min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Choices = 1  # choices returned, each its own engine request (choices.py)
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    seed: StrictInt | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    user: str | None = None
    use_beam_search: StrictBool = False  # vLLM's: the n best of a beam search as wide as best_of or n
    glassformer: Glassformer = Glassformer()

    @model_validator(mode="after")
    def _choices(self):
        best_of = getattr(self, "best_of", None)
        if best_of is not None and best_of < self.n:
            raise InputError("best_of", f"must be at least n ({self.n}), got {best_of}")
        if self.stream and self.use_beam_search:
            raise InputError("use_beam_search", "not with stream=true (the beams are ranked at the end)")
        if self.stream and best_of is not None and best_of > self.n:
            raise InputError("best_of", "not with stream=true (the best are known only at the end)")
        several = self.n > 1 or (best_of or 1) > 1 or self.use_beam_search
        extension = self.glassformer
        if several and (extension.trace or extension.ui or extension.lens is not None):
            raise InputError("glassformer", "trace, ui and lens read one plain choice: not with n or "
                             "best_of above 1, nor use_beam_search")
        return self

    @field_validator("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", mode="before")
    @classmethod
    def _number(cls, value):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InputError(None, "must be a number")
        return float(value)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise InputError(None, "stop strings must not be empty")
        return value

    def params(self, max_new_tokens: int, traced: tuple[Site, ...] = ()) -> RequestParams:
        """The engine's request; `traced`: the trace's sites, parsed (the engine keeps those
        its steps compute; the server traces the rest)."""
        stop = self.stop if self.stop is not None else ()
        return RequestParams(
            max_new_tokens=max_new_tokens,
            sampling=SamplingConfig(
                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty),
            seed=self.seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            eos_ids=() if self.glassformer.ignore_eos else None,  # None: the tokenizer's end ids
            logprobs=self.logprob_count,
            capture=tuple(site for site in traced if kept_in_step(site)),
            ablate=tuple(self.glassformer.ablate),
            lens=None if self.glassformer.lens is None else self.glassformer.lens.top_k,
            lens_layers=None if self.glassformer.lens is None or self.glassformer.lens.layers is None
            else tuple(self.glassformer.lens.layers),
        )

    @property
    def logprob_count(self) -> int | None:
        """None: no log-probabilities; n: each token's and the n likeliest alternatives'."""
        return None


MaxTokens = Annotated[StrictInt, Field(ge=1)] | None


class CompletionRequest(SamplingFields):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[StrictInt, Field(ge=0)]],
                                                            Field(min_length=1)]
    max_tokens: MaxTokens = 16
    echo: Literal[False] = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    suffix: None = None
    best_of: Choices | None = None  # candidates generated; the n of highest log-probability return

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: MaxTokens = None
    max_completion_tokens: MaxTokens = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise InputError("top_logprobs", "needs logprobs set to true")
        return self

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------------- responses

FINISH = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "context_full": "length",
          "cancelled": "abort"}


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
