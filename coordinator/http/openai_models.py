"""OpenAI-compatible bodies for ``/v1/chat/completions`` and ``/v1/completions``.

Request fields fall in three groups:

* implemented: ``model``, ``messages`` / ``prompt``, ``max_tokens`` (and
  ``max_completion_tokens`` for chat), ``temperature`` (0..2), ``top_p`` (0..1], ``n`` (must
  be 1), ``stop`` (a string or up to 4), ``seed``, ``stream``, ``stream_options.include_usage``;
* accepted and ignored: ``user``, ``metadata``, ``store``, ``service_tier``,
  ``parallel_tool_calls``;
* accepted only at their neutral value (otherwise 400 naming them): ``presence_penalty``,
  ``frequency_penalty``, ``logit_bias``, ``logprobs``, ``top_logprobs``, ``response_format``
  (``{"type": "text"}``), ``tools``, ``tool_choice`` (``"none"``), ``functions``,
  ``function_call`` (``"none"``), ``modalities`` (``["text"]``), ``audio``; for completions
  also ``echo``, ``suffix`` and ``best_of`` (1).

Any other field is refused (400), so a misspelt parameter is never silently ignored. ``null``
means "the default" for every optional field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from coordinator.generation.sampling import SamplingParams

MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_TEXT_CHARS = 1_000_000
MAX_REQUEST_TOKENS = 1 << 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for the legacy completions endpoint; chat defaults to the context left."""


def _zero(value: Any) -> bool:
    return value is None or value == 0


def _empty(value: Any) -> bool:
    return value is None or len(value) == 0


def _falsy(value: Any) -> bool:
    return value is None or value is False


def _none_choice(value: Any) -> bool:
    return value is None or value == "none"


class OpenAIBody(BaseModel):
    """Request bodies: frozen; unknown fields refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class StreamOptions(OpenAIBody):
    """``stream_options``."""

    include_usage: bool | None = None


class TextPart(OpenAIBody):
    """A text content part of a chat message."""

    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class ChatMessage(OpenAIBody):
    """One chat message (text content only)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    name: str | None = Field(default=None, max_length=256)

    def text(self) -> str:
        """The message's text (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, str]:
        """The message as the chat template sees it."""
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        return out


class _GenerationBody(OpenAIBody):
    """Fields both endpoints share."""

    _NEUTRAL: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "presence_penalty": _zero,
        "frequency_penalty": _zero,
        "logit_bias": _empty,
    }

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_REQUEST_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("n must be 1 (one choice per request)")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(not 1 <= len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must have 1 to {MAX_STOP_CHARS} characters")
        return value

    @model_validator(mode="after")
    def _neutral_only(self) -> _GenerationBody:
        refused = [name for name, ok in self._NEUTRAL.items() if not ok(getattr(self, name))]
        if refused:
            raise ValueError(
                f"unsupported parameter(s) {', '.join(refused)}: only their default values "
                "are accepted"
            )
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling(self) -> SamplingParams:
        """The sampling parameters (OpenAI defaults: temperature 1, top_p 1)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        return SamplingParams(temperature=temperature, top_p=top_p, seed=self.seed)

    def stop_sequences(self) -> tuple[str, ...]:
        """The stop strings as a tuple."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def streaming(self) -> bool:
        """Whether the answer is an SSE stream."""
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        """The completion budget the client asked for, if any."""
        return self.max_tokens


class ChatCompletionRequest(_GenerationBody):
    """``POST /v1/chat/completions``."""

    _NEUTRAL: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **_GenerationBody._NEUTRAL,
        "logprobs": _falsy,
        "top_logprobs": _zero,
        "response_format": lambda v: v is None or v == {"type": "text"},
        "tools": _empty,
        "tool_choice": _none_choice,
        "functions": _empty,
        "function_call": _none_choice,
        "modalities": lambda v: v is None or v == ["text"],
        "audio": lambda v: v is None,
    }

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_REQUEST_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _bounded_text(self) -> ChatCompletionRequest:
        if sum(len(m.text()) for m in self.messages) > MAX_TEXT_CHARS:
            raise ValueError(f"the messages hold more than {MAX_TEXT_CHARS} characters")
        return self

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` if given, else ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(_GenerationBody):
    """``POST /v1/completions``: ``prompt`` is a string, a one-string list, or token ids."""

    _NEUTRAL: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **_GenerationBody._NEUTRAL,
        "logprobs": lambda v: v is None,
        "echo": _falsy,
        "suffix": _empty,
        "best_of": lambda v: v is None or v == 1,
    }

    prompt: str | list[int] | list[str] = Field(max_length=MAX_TEXT_CHARS)
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(value, list) and value and isinstance(value[0], str) and len(value) != 1:
            raise ValueError("one prompt per request (a string or a list of one string)")
        return value


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """An OpenAI ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class OpenAIErrorDetail(BaseModel):
    """The inside of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """Every error reply of the OpenAI routes (documented in the OpenAPI schema)."""

    error: OpenAIErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": OpenAIErrorBody, "description": text}
    for code, text in (
        (400, "invalid parameters, or prompt plus max_tokens over the context length"),
        (401, "no valid bearer token"),
        (404, "no such model"),
        (429, "no room for a new generation session now (see Retry-After)"),
        (502, "a stage of the model failed"),
        (503, "the model cannot be served now (see Retry-After where a retry can succeed)"),
    )
}
