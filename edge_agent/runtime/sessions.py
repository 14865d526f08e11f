"""Per-session state of a stage: its layers' KV cache, kept on this device between steps.

A segment with state pairs (see :class:`protocols.decoder.StatePair`) runs one *step* of a
session at a time: this table feeds each ``past`` input from the session's previous ``present``
output (an empty tensor on the first step) and keeps the new presents. Sessions are keyed by the
requester's verified name and its session id, so nobody else can step or end them. A step must
say how many tokens the session already holds; a step that does not match (a replayed or
reordered frame) is refused and changes nothing.

Capacity is what the plan reserved memory for (:class:`protocols.manifest.SessionLimits`): a new
session beyond ``max_sessions`` is refused with :class:`SessionLimitError` (the coordinator
answers 503 with Retry-After), a step past ``max_context`` with :class:`ContextLengthError`, and a
session idle for ``idle_timeout_s`` is ended. A step may first *rewind* the session to a position
it already holds (speculative decoding drops the drafted tokens it rejected); a rewind past what
the session holds is refused with :class:`SessionRewindError` and changes nothing. Ending a
session drops its arrays and returns the freed heap to the OS.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edge_agent.errors import (
    ContextLengthError,
    SessionLimitError,
    SessionRewindError,
    SessionStateError,
)
from edge_agent.runtime.checks import Array, InputSpec
from edge_agent.runtime.engine import release_freed_heap
from protocols.decoder import StatePair
from protocols.deploy import ORIGIN_SEPARATOR
from protocols.frames import DTYPES
from protocols.manifest import SessionLimits

Clock = Callable[[], float]


@dataclass
class _Session:
    state: dict[str, Array]
    length: int = 0
    last_used: float = 0.0


@dataclass(frozen=True)
class StepState:
    """What a step of one session starts from."""

    key: str
    position: int
    feeds: dict[str, Array]


class SessionTable:
    """The sessions of one loaded segment (used from the stage's single compute worker)."""

    def __init__(
        self,
        pairs: Sequence[StatePair],
        limits: SessionLimits,
        specs: Sequence[InputSpec],
        clock: Clock = time.monotonic,
    ) -> None:
        self._pairs = tuple(pairs)
        self._limits = limits
        self._clock = clock
        self._sessions: dict[str, _Session] = {}
        by_name = {s.name: s for s in specs}
        self._empty = {p.past: _empty_state(by_name[p.past], p.axis) for p in self._pairs}

    @property
    def pasts(self) -> frozenset[str]:
        """Inputs this table feeds (they never come in a frame)."""
        return frozenset(p.past for p in self._pairs)

    def empty_feeds(self) -> dict[str, Array]:
        """Zero-length state, for a one-shot request that belongs to no session."""
        return dict(self._empty)

    def __len__(self) -> int:
        return len(self._sessions)

    def state_bytes(self) -> int:
        """Bytes held by every session's state."""
        return sum(a.nbytes for s in self._sessions.values() for a in s.state.values())

    def truncate(self, key: str, position: int) -> None:
        """Cut session ``key`` back to its first ``position`` tokens.

        Raises :class:`SessionStateError` for a session this stage does not hold and
        :class:`SessionRewindError` when it holds fewer than ``position`` tokens.
        """
        session = self._sessions.get(key)
        if session is None:
            raise SessionStateError(f"session {key!r} is unknown here; it cannot be rewound")
        if position > session.length:
            raise SessionRewindError(
                f"session {key!r} holds {session.length} tokens; it cannot be rewound to {position}"
            )
        if position == session.length:
            return
        session.state = {p.past: _cut(session.state[p.past], p.axis, position) for p in self._pairs}
        session.length = position

    def begin_step(self, key: str, position: int, rewind: bool = False) -> StepState:
        """The past feeds for a step of session ``key`` that starts at ``position`` tokens
        (after cutting the session back to ``position`` when ``rewind`` is set)."""
        self.expire()
        session = self._sessions.get(key)
        if session is not None and rewind:
            self.truncate(key, position)
        if session is None:
            if position != 0:
                raise SessionStateError(
                    f"session {key!r} is unknown here (ended, timed out or lost); "
                    f"it cannot continue at position {position}"
                )
            if len(self._sessions) >= self._limits.max_sessions:
                raise SessionLimitError(
                    f"all {self._limits.max_sessions} sessions this stage has memory for are "
                    "in use; retry when one ends"
                )
            session = self._sessions[key] = _Session(state=dict(self._empty))
        elif position != session.length:
            raise SessionStateError(
                f"session {key!r} holds {session.length} tokens, the step says {position} "
                "(a replayed or out-of-order frame)"
            )
        session.last_used = self._clock()
        return StepState(key, position, dict(session.state))

    def end_step(self, step: StepState, outputs: Mapping[str, Array]) -> int:
        """Keep the step's presents; returns the session's new length in tokens.

        A step that would grow the session past ``max_context`` is refused and leaves the
        session as it was.
        """
        session = self._sessions.get(step.key)
        if session is None or session.length != step.position:
            raise SessionStateError(f"session {step.key!r} changed while its step ran")
        grown = {p.past: outputs[p.present] for p in self._pairs}
        length = _length(grown, self._pairs)
        if length > self._limits.max_context:
            raise ContextLengthError(
                f"session {step.key!r} would hold {length} tokens, over the "
                f"{self._limits.max_context} this deployment was planned for"
            )
        session.state, session.length = grown, length
        session.last_used = self._clock()
        return length

    def discard(self, key: str) -> None:
        """Drop a session whose first step failed (so a refused prompt holds no slot)."""
        session = self._sessions.get(key)
        if session is not None and session.length == 0:
            del self._sessions[key]

    def end(self, key: str) -> bool:
        """End a session and free its state; False if it was not here."""
        if self._sessions.pop(key, None) is None:
            return False
        release_freed_heap()
        return True

    def expire(self) -> list[str]:
        """End every session idle for longer than the timeout; returns their keys."""
        cutoff = self._clock() - self._limits.idle_timeout_s
        stale = [k for k, s in self._sessions.items() if s.last_used < cutoff]
        for key in stale:
            del self._sessions[key]
        if stale:
            release_freed_heap()
        return stale

    def clear(self) -> None:
        """End every session (the segment is unloaded)."""
        self._sessions.clear()
        release_freed_heap()


def _empty_state(spec: InputSpec, axis: int) -> Array:
    """A zero-length state: free dimensions other than ``axis`` are 1 (batch of one)."""
    shape = [0 if k == axis else (d if isinstance(d, int) else 1) for k, d in enumerate(spec.shape)]
    array: Array = np.zeros(shape, DTYPES[spec.dtype])
    array.flags.writeable = False
    return array


def _cut(array: Array, axis: int, length: int) -> Array:
    """The first ``length`` entries of ``array`` along ``axis``, as a compact read-only copy
    (a view would keep the dropped entries' memory alive)."""
    index = [slice(None)] * array.ndim
    index[axis] = slice(0, length)
    cut: Array = np.ascontiguousarray(array[tuple(index)])
    cut.flags.writeable = False
    return cut


def _length(state: Mapping[str, Array], pairs: Sequence[StatePair]) -> int:
    lengths = {state[p.past].shape[p.axis] for p in pairs}
    if len(lengths) != 1:
        raise SessionStateError(f"the segment's state tensors disagree on length: {lengths}")
    return int(lengths.pop())


def session_key(routed_request_id: str, session_id: str) -> str:
    """The key of a session: the requester's verified name (the routed request id's prefix)
    and its session id."""
    requester = routed_request_id.rpartition(ORIGIN_SEPARATOR)[0]
    return f"{requester}{ORIGIN_SEPARATOR}{session_id}"


def check_session_fields(
    has_sessions: bool,
    session_id: str | None,
    position: int | None,
    end: bool,
    rewind: bool = False,
) -> str | None:
    """Why a frame's session fields do not fit the deployment, or None when they do.

    ``has_sessions``: the deployment keeps per-session state (on this stage or another).
    """
    if rewind and (session_id is None or end or position is None):
        return "session_rewind needs a session step (session_id and session_position, no end)"
    if not has_sessions:
        if session_id is not None or end:
            return "this deployment keeps no sessions"
        return None
    if session_id is None:
        return "session_end needs a session_id" if end else None
    if position is None and not end:
        return "a session step needs session_position"
    return None
