"""OpenAI-compatible text generation routes (mounted under the token-protected ``/v1``)::

    POST /v1/chat/completions   chat messages through the model's chat template
    POST /v1/completions        a plain prompt (text, or token ids)

Both answer JSON, or a server-sent event stream with ``"stream": true``: ``data: {chunk}``
events, then ``data: [DONE]``. Chat chunks carry ``delta.role`` first, then ``delta.content``;
the last chunk with a choice has the ``finish_reason``; with
``stream_options.include_usage`` every chunk has ``"usage": null`` and one more chunk with no
choices carries the usage. Every error, including a missing token (401) and a malformed body
(400), is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``; an unknown
model is 404, no room for a new session 429 with ``Retry-After``. An error after a stream has
started is sent as one ``data: {"error": ...}`` event before ``[DONE]``. Never a stack trace.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from coordinator.errors import (
    CoordinatorError,
    RequestError,
    UnknownModelError,
)
from coordinator.generation.backend import GenerationModel, ModelLookup
from coordinator.generation.engine import (
    Finished,
    GenerationRequest,
    TextDelta,
    Usage,
    generate,
)
from coordinator.http.errors import OpenAIErrorRoute, openai_body, render
from coordinator.http.metrics import CoordinatorMetrics, notes
from coordinator.http.openai_models import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ERROR_RESPONSES,
    ChatCompletionRequest,
    CompletionRequest,
    usage_json,
)

log = logging.getLogger(__name__)


def generation_router(models: ModelLookup, metrics: CoordinatorMetrics | None = None) -> APIRouter:
    """The generation routes over ``models`` (model name to backend, tokenizer and info),
    counted into ``metrics`` (tokens, open sessions) when given."""
    api = APIRouter(route_class=OpenAIErrorRoute, responses=ERROR_RESPONSES)

    @api.post("/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        model = _lookup(models, body.model)
        notes(request).model = body.model
        messages = [m.for_template() for m in body.messages]
        prompt = await run_in_threadpool(_chat_prompt, model, messages)
        shape = _Shape.new("chat", body.model)
        default = max(1, model.info.max_context - len(prompt))
        budget = body.requested_max_tokens() or default
        return await _respond(model, body, prompt, budget, shape, metrics)

    @api.post("/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = _lookup(models, body.model)
        notes(request).model = body.model
        prompt = await run_in_threadpool(_completion_prompt, model, body.prompt)
        shape = _Shape.new("text", body.model)
        budget = body.requested_max_tokens() or COMPLETIONS_DEFAULT_MAX_TOKENS
        return await _respond(model, body, prompt, budget, shape, metrics)

    return api


def _lookup(models: ModelLookup, name: str) -> GenerationModel:
    model = models(name)
    if model is None:
        raise UnknownModelError(f"the model {name!r} does not exist")
    return model


def _chat_prompt(model: GenerationModel, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of chat messages rendered through the model's template."""
    return model.tokenizer.encode(model.tokenizer.render_chat(messages))


def _completion_prompt(model: GenerationModel, prompt: str | list[int] | list[str]) -> list[int]:
    """Token ids of a completions prompt: text is encoded after BOS; ids are used as given."""
    if isinstance(prompt, str):
        return model.tokenizer.encode_prompt(prompt)
    if prompt and isinstance(prompt[0], str):
        return model.tokenizer.encode_prompt(str(prompt[0]))
    ids = [int(t) for t in prompt]
    vocab = model.info.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise RequestError(f"prompt token ids must be in [0, {vocab})")
    return ids


@dataclass(frozen=True)
class _Shape:
    """Builds the response objects of one request (chat or text completion)."""

    kind: Literal["chat", "text"]
    id: str
    created: int
    model: str

    @classmethod
    def new(cls, kind: Literal["chat", "text"], model: str) -> _Shape:
        """A fresh id and timestamp for one response."""
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(kind, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

    def _head(self, suffix: str) -> dict[str, Any]:
        name = "chat.completion" if self.kind == "chat" else "text_completion"
        obj = name + suffix if self.kind == "chat" else name
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def complete(self, text: str, finished: Finished) -> dict[str, Any]:
        """The non-streamed answer."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["finish_reason"] = finished.finish_reason
        usage = finished.usage
        return {
            **self._head(""),
            "choices": [choice],
            "usage": usage_json(usage.prompt_tokens, usage.completion_tokens),
        }

    def chunk(
        self, text: str | None, finish: str | None, usage: bool, role: bool = False
    ) -> dict[str, Any]:
        """One streamed chunk with one choice."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None}
        if self.kind == "chat":
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["finish_reason"] = finish
        out = {**self._head(".chunk"), "choices": [choice]}
        if usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The final chunk of a stream with ``include_usage``: no choices, the usage."""
        counts = usage_json(usage.prompt_tokens, usage.completion_tokens)
        return {**self._head(".chunk"), "choices": [], "usage": counts}


async def _respond(
    model: GenerationModel,
    body: ChatCompletionRequest | CompletionRequest,
    prompt: list[int],
    max_tokens: int,
    shape: _Shape,
    metrics: CoordinatorMetrics | None = None,
) -> Response:
    request = GenerationRequest(
        prompt, max_tokens, body.sampling(), body.stop_sequences(), session=shape.id
    )
    events = generate(model, request)
    if metrics is not None:
        events = metrics.generation(shape.model, events, _usage_of)
    if not body.streaming:
        async with aclosing(events):
            pieces: list[str] = []
            async for event in events:
                if isinstance(event, TextDelta):
                    pieces.append(event.text)
                elif isinstance(event, Finished):
                    return JSONResponse(shape.complete("".join(pieces), event))
        raise CoordinatorError("the generation ended without finishing")
    await anext(events)  # the prefill: errors before this point are plain HTTP errors
    stream = _sse(events, shape, body.include_usage)
    return SseResponse(stream, close=events.aclose)


async def _sse(events: AsyncIterator[Any], shape: _Shape, usage: bool) -> AsyncIterator[str]:
    """The event stream of a started generation."""
    if shape.kind == "chat":
        yield _data(shape.chunk("", None, usage, role=True))
    try:
        async for event in events:
            if isinstance(event, TextDelta):
                yield _data(shape.chunk(event.text, None, usage))
            elif isinstance(event, Finished):
                yield _data(
                    shape.chunk(None if shape.kind == "chat" else "", event.finish_reason, usage)
                )
                if usage:
                    yield _data(shape.usage_chunk(event.usage))
    except Exception as exc:  # after the headers went out, the error travels in the stream
        body = openai_body(render(exc))
        log.error(
            "%s: stream failed: %s", shape.id, exc, exc_info=not isinstance(exc, CoordinatorError)
        )
        yield _data(body)
    yield "data: [DONE]\n\n"


def _usage_of(event: object) -> Usage | None:
    return event.usage if isinstance(event, Finished) else None


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


class SseResponse(StreamingResponse):
    """A ``text/event-stream`` response that always closes its stream and the generation.

    Starlette cancels a streaming response when the client disconnects but leaves its iterator
    suspended; closing both here (shielded) runs the generation's cleanup at once, so the
    backend session is ended then and not whenever the garbage collector gets to it.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], close: Callable[[], Awaitable[None]]) -> None:
        """Stream ``content``; await ``close`` when the response is over, however it ends."""
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self._stream = content
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the stream, then close it and the generation whatever happened."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._stream, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._close()
