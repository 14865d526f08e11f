"""Models of the API's replies that its routes build as plain JSON, for the typed client
(:mod:`coordinator.client`) to read them: the embeddings list (OpenAI's shape), the failover
view, and one chunk of a streamed completion.

They only read: ``extra="ignore"`` on the OpenAI shapes, which other servers extend, and the
fields the routes write on our own.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from coordinator.serving.failover import FailoverEvent


class _Read(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class Embedding(_Read):
    """One vector of ``POST /v1/embeddings``: floats, or base64 when asked for."""

    index: int
    embedding: list[float] | str


class EmbeddingsUsage(_Read):
    """The tokens an embeddings request read."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingsReply(_Read):
    """``POST /v1/embeddings``; ``plan_version`` from the ``X-Fedshard-Plan-Version`` header
    (the plan version that computed every vector)."""

    model: str
    data: list[Embedding]
    usage: EmbeddingsUsage
    plan_version: int | None = None

    def vectors(self) -> list[list[float]]:
        """The float vectors in input order (a base64 reply has none: ValueError)."""
        ordered = sorted(self.data, key=lambda e: e.index)
        if any(isinstance(e.embedding, str) for e in ordered):
            raise ValueError("the embeddings were asked for as base64")
        return [list(e.embedding) for e in ordered]  # type: ignore[arg-type]


class FailoverCondition(_Read):
    """A model that its active version does not serve now."""

    state: Literal["recovering", "unavailable"]
    plan_version: int
    reason: str


class FailoverView(_Read):
    """``GET /v1/failover``: whether failover runs, the models it is handling, its events."""

    enabled: bool
    models: dict[str, FailoverCondition]
    events: list[FailoverEvent]


class CompletionChunk(_Read):
    """One ``data:`` chunk of a streamed ``/v1/completions`` or ``/v1/chat/completions``."""

    choices: list[dict[str, Any]] = []
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    def text(self) -> str:
        """The chunk's piece of text (a completion's ``text`` or a chat delta's ``content``)."""
        if not self.choices:
            return ""
        choice = self.choices[0]
        if "text" in choice:
            return str(choice["text"] or "")
        return str((choice.get("delta") or {}).get("content") or "")
