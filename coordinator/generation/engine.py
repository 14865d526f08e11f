"""One generation: prefill, then decode steps until a limit, an EOS token or a stop string.

:func:`generate` is an async generator of events: :class:`Started` once the prompt has been
accepted by the backend (so a caller can still answer with an HTTP error before that), then
:class:`TextDelta` pieces, then one :class:`Finished` with the finish reason and usage.

* ``finish_reason`` is ``"stop"`` for an EOS id or a stop string and ``"length"`` when
  ``max_tokens`` tokens were generated.
* ``completion_tokens`` counts every sampled token, including the EOS token or the token that
  completed a stop string.
* Stop strings are matched on the detokenized text. Text that could still become a stop
  string is held back, so no part of a stop string is ever yielded; the stop string itself is
  not part of the output.
* The backend's :meth:`~coordinator.generation.backend.DecoderBackend.end` is called exactly
  once for the session when the generation ends, fails, is cancelled or is closed early
  (shielded from cancellation). Consumers must close the generator (``contextlib.aclosing``)
  if they stop iterating before :class:`Finished`.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import anyio
import numpy as np

from coordinator.errors import ContextLengthError, RequestError
from coordinator.generation.backend import GenerationModel, TopCandidates
from coordinator.generation.drafters import Drafter
from coordinator.generation.sampling import SamplingParams, choose, make_rng
from coordinator.generation.speculative import (
    VerifyingBackend,
    prefill_with_drafter,
    speculative_tokens,
)

log = logging.getLogger(__name__)
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: prompt ids, a token budget, how to sample, where to stop."""

    prompt_ids: Sequence[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    session: str = field(default_factory=lambda: uuid.uuid4().hex)
    """The backend session id (unique per generation)."""


@dataclass(frozen=True)
class Usage:
    """OpenAI-style token counts."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Started:
    """The backend accepted the prompt (the first step succeeded)."""

    prompt_tokens: int


@dataclass(frozen=True)
class TextDelta:
    """New output text (never empty, never part of a stop string)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The generation is over."""

    finish_reason: FinishReason
    usage: Usage


Event = Started | TextDelta | Finished


def check_budget(prompt_tokens: int, max_tokens: int, max_context: int) -> None:
    """Raise :class:`ContextLengthError` unless prompt and completion fit the context."""
    if prompt_tokens < 1:
        raise RequestError("the prompt is empty")
    if max_tokens < 1:
        raise RequestError("max_tokens must be at least 1")
    if prompt_tokens + max_tokens > max_context:
        raise ContextLengthError(max_context, prompt_tokens, max_tokens)


async def generate(
    model: GenerationModel, request: GenerationRequest
) -> AsyncGenerator[Event, None]:
    """Run one generation on ``model``; see the module docstring for the events."""
    prompt = [int(t) for t in request.prompt_ids]
    check_budget(len(prompt), request.max_tokens, model.info.max_context)
    backend, session = model.backend, request.session
    drafter = _drafter(model)
    try:
        if drafter is None:
            candidates = await backend.step(session, 0, prompt)
        else:
            candidates = await prefill_with_drafter(
                lambda: backend.step(session, 0, prompt), drafter, prompt
            )
        yield Started(len(prompt))
        rng = make_rng(request.sampling.seed)
        eos = frozenset(model.info.eos_token_ids)
        text = _StopFilter(request.stop)
        detok = model.tokenizer.incremental()
        generated = 0
        reason: FinishReason = "length"
        tokens = _tokens(model, request, prompt, candidates, rng, drafter)
        async with contextlib.aclosing(tokens):
            async for token in tokens:
                generated += 1
                if token in eos:
                    reason = "stop"
                    break
                piece = text.feed(detok.push(token))
                if piece:
                    yield TextDelta(piece)
                if text.stopped:
                    reason = "stop"
                    break
                if generated >= request.max_tokens:
                    break
        if not text.stopped:
            tail = text.feed(detok.flush())
            tail += text.flush()
            if tail:
                yield TextDelta(tail)
            if text.stopped:
                reason = "stop"
        yield Finished(reason, Usage(len(prompt), generated))
    finally:
        await _end(model, session)


def _drafter(model: GenerationModel) -> Drafter | None:
    """A new drafter for one generation, when the model speculates (else None)."""
    if model.speculation is not None and isinstance(model.backend, VerifyingBackend):
        return model.speculation.drafters()
    return None


def _tokens(
    model: GenerationModel,
    request: GenerationRequest,
    prompt: list[int],
    first: TopCandidates,
    rng: np.random.Generator,
    drafter: Drafter | None,
) -> AsyncGenerator[int, None]:
    """The generated tokens, one chain step each, or verified in passes with ``drafter``'s
    drafts when the model speculates (:mod:`coordinator.generation.speculative`)."""
    if drafter is not None and model.speculation is not None:
        assert isinstance(model.backend, VerifyingBackend)  # as _drafter checked
        return speculative_tokens(
            model.backend,
            request.session,
            prompt,
            first,
            request.max_tokens,
            request.sampling,
            rng,
            model.speculation,
            drafter,
        )
    return _plain_tokens(model, request, len(prompt), first, rng)


async def _plain_tokens(
    model: GenerationModel,
    request: GenerationRequest,
    position: int,
    candidates: TopCandidates,
    rng: np.random.Generator,
) -> AsyncGenerator[int, None]:
    """One token per step: choose from the candidates, feed it, repeat."""
    while True:
        token = choose(candidates, request.sampling, rng)
        yield token
        candidates = await model.backend.step(request.session, position, [token])
        position += 1


async def _end(model: GenerationModel, session: str) -> None:
    """Tell the backend the session is over, even while the caller is being cancelled."""
    with anyio.CancelScope(shield=True):
        try:
            await model.backend.end(session)
        except Exception:
            # The generation's own outcome (or error) is what the caller must see; a failed
            # release is the backend's problem, reported here.
            log.exception("backend.end(%s) failed", session)


class _StopFilter:
    """Holds back text that may start a stop string; finds the first complete one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add ``piece``; the text that is now safe to emit."""
        if self.stopped:
            return ""
        self._pending += piece
        if not self._stops:
            out, self._pending = self._pending, ""
            return out
        hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self._pending = self._pending[: min(hits)], ""
            return out
        keep = self._held_length()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """Everything held back, once the generation has ended without a stop string."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _held_length(self) -> int:
        """Length of the longest suffix of the pending text that is a prefix of a stop."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:size]):
                    longest = size
                    break
        return longest
