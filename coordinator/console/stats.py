"""Request counters for the console's live view: requests per second and latency percentiles.

:class:`RequestStats` keeps the completion time, duration and outcome of recent inference
requests in a bounded window; :class:`InferenceCounter` feeds it from the coordinator's one
request timer (:class:`~coordinator.http.timing.RequestTimer`), which times each request from
arrival until the last byte of its response (a streamed chat answer counts until its final
token).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

TIMED_PATHS: frozenset[str] = frozenset(
    {"/v1/infer", "/v1/embeddings", "/v1/chat/completions", "/v1/completions"}
)
"""The inference routes whose requests are counted."""


class Latency(BaseModel):
    """Latency percentiles in milliseconds (``None`` with no request in the window)."""

    model_config = ConfigDict(frozen=True)

    p50: float | None
    p95: float | None
    p99: float | None


class RequestSnapshot(BaseModel):
    """What the counters say at one moment."""

    model_config = ConfigDict(frozen=True)

    requests_per_s: float
    """Requests completed per second over the last ``rate_window_s`` seconds."""
    errors_per_s: float
    latency_ms: Latency
    """Over the requests completed in the last ``window_s`` seconds."""
    total: int
    errors: int


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ascending values, nearest-rank; None if empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


@dataclass(frozen=True)
class _Done:
    at: float
    seconds: float
    ok: bool


class RequestStats:
    """Thread-safe counters of completed requests over a sliding window."""

    def __init__(
        self,
        window_s: float = 30.0,
        rate_window_s: float = 5.0,
        max_kept: int = 20_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._window = window_s
        self._rate_window = rate_window_s
        self._clock = clock
        self._done: deque[_Done] = deque(maxlen=max_kept)
        self._total = 0
        self._errors = 0
        self._lock = threading.Lock()

    @property
    def clock(self) -> Callable[[], float]:
        """The clock durations are measured with."""
        return self._clock

    def record(self, seconds: float, ok: bool) -> None:
        """Count one request that just completed after ``seconds``."""
        with self._lock:
            self._done.append(_Done(self._clock(), seconds, ok))
            self._total += 1
            self._errors += 0 if ok else 1

    def snapshot(self) -> RequestSnapshot:
        """Rates and percentiles now."""
        now = self._clock()
        with self._lock:
            while self._done and self._done[0].at < now - self._window:
                self._done.popleft()
            recent = list(self._done)
            total, errors = self._total, self._errors
        in_rate = [d for d in recent if d.at >= now - self._rate_window]
        durations = sorted(d.seconds * 1e3 for d in recent)
        return RequestSnapshot(
            requests_per_s=len(in_rate) / self._rate_window,
            errors_per_s=sum(not d.ok for d in in_rate) / self._rate_window,
            latency_ms=Latency(
                p50=percentile(durations, 50),
                p95=percentile(durations, 95),
                p99=percentile(durations, 99),
            ),
            total=total,
            errors=errors,
        )


class InferenceCounter:
    """Counts POSTs to :data:`TIMED_PATHS` into a :class:`RequestStats`: an observer of the
    coordinator's one request timer (:class:`~coordinator.http.timing.RequestTimer`).

    A request counts as an error when its status is 400 or more, or when the application
    raised before finishing its response.
    """

    def __init__(self, stats: RequestStats, paths: Collection[str] = TIMED_PATHS) -> None:
        """Count into ``stats`` the requests to ``paths``."""
        self.stats = stats
        self.paths = frozenset(paths)

    def __call__(self, request: TimedInference) -> None:
        """Record ``request`` if it is an inference POST."""
        scope = request.scope
        if scope.get("method") == "POST" and scope.get("path") in self.paths:
            self.stats.record(request.seconds, request.done and request.status < 400)


class TimedInference(Protocol):
    """What :class:`InferenceCounter` reads of a timed request."""

    @property
    def scope(self) -> Mapping[str, Any]:
        """The request's ASGI scope."""

    @property
    def status(self) -> int:
        """The response's status (500 when the application raised before starting one)."""

    @property
    def done(self) -> bool:
        """Whether the response's last body message went out."""

    @property
    def seconds(self) -> float:
        """From arrival until the response ended."""
