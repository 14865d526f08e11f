"""The interface the generation engine drives: one decoder, many sessions.

A *session* is one generation. The engine calls :meth:`DecoderBackend.step` with the session's
new tokens (the whole prompt first, then one sampled token per step) and the position of the
first of them (the number of tokens the session already holds); the backend answers with the
top-k next-token candidates of the last position, as the ``fedshard.decoder/1`` graph does
(:mod:`protocols.decoder`). The engine calls :meth:`DecoderBackend.end` exactly once for every
session it has stepped, whatever happened (finished, failed, cancelled, client gone), so the
backend can free that session's KV cache on every stage.

Backends signal typed errors from :mod:`coordinator.errors`:
:class:`~coordinator.errors.CapacityError` when there is no room for a new session now (the API
answers 503 with ``Retry-After``), :class:`~coordinator.errors.ContextLengthError` when a
position would pass the context window, and :class:`~coordinator.errors.AgentError` when a
stage fails. Many sessions are stepped concurrently (one asyncio task per request), so a
pipelined backend can keep every stage busy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import NDArray

from protocols.decoder import DecoderInfo

if TYPE_CHECKING:
    from coordinator.generation.speculative import Speculation
    from coordinator.generation.tokenizer import ChatTokenizer


@dataclass(frozen=True, eq=False)
class TopCandidates:
    """The top-k next-token candidates of one step, largest logit first."""

    logits: NDArray[np.float32]
    """float32 ``[k]``, descending."""
    ids: NDArray[np.int64]
    """int64 ``[k]``: the token id of each logit."""

    def __post_init__(self) -> None:
        if self.logits.ndim != 1 or self.ids.shape != self.logits.shape or self.logits.size == 0:
            raise ValueError(
                f"candidates need matching non-empty 1-D logits and ids, got "
                f"{self.logits.shape} and {self.ids.shape}"
            )

    @classmethod
    def of(cls, logits: Any, ids: Any) -> TopCandidates:
        """Candidates from array-likes (``[k]`` or ``[1, k]``), cast to float32 and int64."""
        return cls(
            np.asarray(logits, dtype=np.float32).reshape(-1),
            np.asarray(ids, dtype=np.int64).reshape(-1),
        )


class DecoderBackend(Protocol):
    """Runs one decoder model for many concurrent sessions."""

    async def step(self, session: str, position: int, token_ids: Sequence[int]) -> TopCandidates:
        """Append ``token_ids`` at ``position`` to ``session``; the next-token candidates.

        ``position`` is 0 on the first call of a session (the prompt), then the number of
        tokens the session already holds. Raises :class:`coordinator.errors.CapacityError`
        when a new session cannot be admitted now.
        """
        ...

    async def end(self, session: str) -> None:
        """Forget ``session`` and free its state (called once per stepped session)."""
        ...


@dataclass(frozen=True)
class GenerationModel:
    """Everything the API needs to generate with one deployed decoder."""

    backend: DecoderBackend
    tokenizer: ChatTokenizer
    info: DecoderInfo
    speculation: Speculation | None = None
    """How the model speculates (None: one chain step per token)."""


ModelLookup = Callable[[str], GenerationModel | None]
"""Model name (the request's ``model`` field) to its generation model, or ``None`` if unknown."""
