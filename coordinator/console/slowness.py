"""Slow devices: each stage's measured compute time per request against what the plan expects.

The plan predicts each stage's compute time from the devices' announced speed
(``predicted_compute_s`` in the deployment record). While serving, the agents'
``fedshard_compute_seconds`` histograms give the measured mean compute time per request over a
window. Requests shorter or longer than the planner's reference input change every stage's time
alike, and so does a busy host shared by all stages, so a stage is compared with its peers: its
ratio *measured / predicted* divided by the lower median of the other stages' ratios is its
**slowdown** (with a single stage, or no peer with enough samples, the ratio itself). A stage
whose slowdown reaches :data:`SLOW_FACTOR` over a window of at least :data:`MIN_SPAN_S` seconds
and :data:`MIN_SAMPLES` requests is flagged, with the suggestion to re-plan: the plan gave it a
share sized for a faster device. The suggestion's what-if is that re-plan, computed on the new
measurements: the device's roofs scaled by its slowdown, so it keeps a share it can carry at
the speed it runs now (or none, when the others do better without it).

The warm-up time an agent measured at deploy is the fallback when a plan predicted nothing; it
is a poor reference otherwise (three runs, taken while the other stages load, so one noisy
warm-up would make its peers look slow).

:func:`find_slow` is the rule (pure, on plain numbers); :class:`SlownessSampler` keeps the
recent cumulative counters of each stage and turns them into windows for it.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

SLOW_FACTOR = 2.0
"""A stage this many times slower than planned (relative to its peers) is flagged."""
WINDOW_S = 30.0
"""How far back the window reaches."""
MIN_SPAN_S = 10.0
"""A window must span at least this long: one burst does not make a device slow."""
MIN_SAMPLES = 30
"""Requests a stage must have computed in the window to be judged."""


@dataclass(frozen=True)
class StageWindow:
    """One stage over a window: what the plan expects per request and what was measured."""

    index: int
    device: str
    expected_s: float
    """The plan's predicted compute time per request (or the warm-up time at deploy)."""
    compute_s: float
    """Compute seconds summed over the window."""
    requests: float
    """Requests computed in the window."""

    @property
    def mean_s(self) -> float:
        """Measured compute time per request."""
        return self.compute_s / self.requests if self.requests > 0 else 0.0


class SlowStage(BaseModel):
    """A stage that runs persistently slower than planned, and what to do about it."""

    model_config = ConfigDict(frozen=True)

    index: int
    device: str
    slowdown: float
    """Measured time over expected time, both per request (see the module docs)."""
    measured_ms: float
    expected_ms: float
    """The predicted time scaled by the peers' measured/predicted ratio: the stage time that
    this load would take on the device the plan assumed."""
    requests: int
    message: str
    """In plain words, with the suggestion."""


def find_slow(
    windows: Sequence[StageWindow],
    factor: float = SLOW_FACTOR,
    min_samples: int = MIN_SAMPLES,
) -> list[SlowStage]:
    """The stages whose slowdown is at least ``factor``, slowest first."""
    ratios = {
        w.index: w.mean_s / w.expected_s
        for w in windows
        if w.requests >= min_samples and w.expected_s > 0
    }
    slow: list[SlowStage] = []
    for window in windows:
        ratio = ratios.get(window.index)
        if ratio is None:
            continue
        peers = [r for i, r in ratios.items() if i != window.index]
        reference = statistics.median_low(peers) if peers else 1.0
        if reference <= 0:
            continue
        slowdown = ratio / reference
        if slowdown >= factor:
            slow.append(_slow_stage(window, slowdown, window.expected_s * reference))
    return sorted(slow, key=lambda s: -s.slowdown)


def _slow_stage(window: StageWindow, slowdown: float, expected_s: float) -> SlowStage:
    message = (
        f"stage {window.index + 1} on {window.device} runs {slowdown:.1f}x slower than planned "
        f"({window.mean_s * 1e3:.1f} ms per request, {expected_s * 1e3:.1f} ms expected over "
        f"{int(window.requests)} requests); re-plan with its measured speed (a smaller share, "
        "or none)"
    )
    return SlowStage(
        index=window.index,
        device=window.device,
        slowdown=round(slowdown, 3),
        measured_ms=round(window.mean_s * 1e3, 3),
        expected_ms=round(expected_s * 1e3, 3),
        requests=int(window.requests),
        message=message,
    )


@dataclass(frozen=True)
class StageReading:
    """One scrape of one stage: cumulative compute counters of its agent, and the plan's time
    per request (``expected_s``, see :class:`StageWindow`)."""

    plan_version: int
    index: int
    device: str
    expected_s: float
    at: float
    """Monotonic seconds of the scrape."""
    compute_s: float
    requests: float


@dataclass(frozen=True)
class _Point:
    at: float
    compute_s: float
    requests: float


class SlownessSampler:
    """Keeps each stage's recent readings and judges the window they span.

    Readings are keyed by plan version, stage and device, so a new deployment starts afresh; an
    agent whose counters went backwards (it restarted) starts afresh too. Thread-safe.
    """

    def __init__(
        self,
        window_s: float = WINDOW_S,
        min_span_s: float = MIN_SPAN_S,
        min_samples: int = MIN_SAMPLES,
        factor: float = SLOW_FACTOR,
    ) -> None:
        self._window = window_s
        self._min_span = min_span_s
        self._min_samples = min_samples
        self._factor = factor
        self._history: dict[tuple[int, int, str], deque[_Point]] = {}
        self._lock = threading.Lock()

    def observe(self, readings: Sequence[StageReading]) -> list[SlowStage]:
        """Record one scrape of a version's stages; the slow ones over the current window."""
        windows = []
        with self._lock:
            for reading in readings:
                window = self._record(reading)
                if window is not None:
                    windows.append(window)
            self._forget_stale(max((r.at for r in readings), default=0.0))
        return find_slow(windows, self._factor, self._min_samples)

    def _record(self, reading: StageReading) -> StageWindow | None:
        key = (reading.plan_version, reading.index, reading.device)
        points = self._history.setdefault(key, deque())
        if points and reading.requests < points[-1].requests:
            points.clear()  # the agent restarted: its counters began again
        points.append(_Point(reading.at, reading.compute_s, reading.requests))
        while len(points) > 1 and points[1].at <= reading.at - self._window:
            points.popleft()  # the base is the newest reading at least a window old
        first, last = points[0], points[-1]
        if last.at - first.at < self._min_span:
            return None
        return StageWindow(
            index=reading.index,
            device=reading.device,
            expected_s=reading.expected_s,
            compute_s=max(0.0, last.compute_s - first.compute_s),
            requests=last.requests - first.requests,
        )

    def _forget_stale(self, now: float) -> None:
        stale = [k for k, p in self._history.items() if p and p[-1].at < now - 4 * self._window]
        for key in stale:
            del self._history[key]
