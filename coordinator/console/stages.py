"""Per-stage pipeline metrics for the console, from the agents' Prometheus ``/metrics``.

An agent's metrics are cumulative counters (compute and send seconds, requests, bytes). The
console wants rates: what share of wall time each stage spent computing, sending and idle, and
how many requests per second passed through it. :func:`parse_counters` reads one scrape,
:func:`rates` turns two scrapes into rates, and :class:`StageSampler` scrapes the stages of a
deployed version and keeps the previous scrape of each device to compute the next rates.

Idle is the compute worker's share of wall time not spent computing: the agent counts idle time
only when work arrives, so the counter lags while a stage sits idle.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict

from coordinator.errors import AgentError


@dataclass(frozen=True)
class Counters:
    """The cumulative numbers of one scrape that the console uses."""

    at: float
    """When the scrape was taken (monotonic seconds)."""
    compute_s: float = 0.0
    compute_count: float = 0.0
    send_s: float = 0.0
    send_count: float = 0.0
    queue_wait_s: float = 0.0
    bytes_out: float = 0.0
    requests: float = 0.0
    compute_queue: float = 0.0
    send_queue: float = 0.0
    resident_bytes: float = 0.0


_SAMPLES: dict[str, str] = {
    "fedshard_compute_seconds_sum": "compute_s",
    "fedshard_compute_seconds_count": "compute_count",
    "fedshard_send_seconds_sum": "send_s",
    "fedshard_send_seconds_count": "send_count",
    "fedshard_queue_wait_seconds_sum": "queue_wait_s",
    "fedshard_bytes_out_total": "bytes_out",
    "fedshard_resident_memory_bytes": "resident_bytes",
}


def parse_counters(text: str, at: float) -> Counters:
    """The console's numbers from a Prometheus text exposition; raises ValueError if unreadable."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = _SAMPLES.get(sample.name)
            if field is not None:
                values[field] = float(sample.value)
            elif sample.name == "fedshard_requests_total":
                values["requests"] = values.get("requests", 0.0) + float(sample.value)
            elif sample.name == "fedshard_queue_depth":
                queue = sample.labels.get("queue", "")
                if queue in ("compute", "send"):
                    values[f"{queue}_queue"] = float(sample.value)
    return Counters(at=at, **values)


class StageRates(BaseModel):
    """One stage over the last sampling interval."""

    model_config = ConfigDict(frozen=True)

    index: int
    device: str
    compute_share: float | None = None
    """Share of wall time the stage spent computing (0-1)."""
    send_share: float | None = None
    """Share of wall time spent handing frames to the next stage."""
    idle_share: float | None = None
    requests_per_s: float | None = None
    mean_compute_ms: float | None = None
    mean_send_ms: float | None = None
    sent_mb_per_s: float | None = None
    queued: int | None = None
    """Frames waiting for compute or send right now."""
    resident_bytes: int | None = None
    error: str | None = None
    """Why the stage could not be read, in plain words."""


def rates(index: int, device: str, before: Counters | None, now: Counters) -> StageRates:
    """Rates between two scrapes of one device (only gauges when there is no earlier scrape)."""
    gauges = {
        "queued": int(now.compute_queue + now.send_queue),
        "resident_bytes": int(now.resident_bytes),
    }
    elapsed = now.at - before.at if before is not None else 0.0
    if before is None or elapsed <= 0:
        return StageRates(index=index, device=device, **gauges)
    if now.compute_count < before.compute_count:  # the agent restarted: counters reset
        return StageRates(index=index, device=device, **gauges)
    compute = max(0.0, now.compute_s - before.compute_s)
    send = max(0.0, now.send_s - before.send_s)
    computed = now.compute_count - before.compute_count
    sent = now.send_count - before.send_count
    compute_share = min(1.0, compute / elapsed)
    return StageRates(
        index=index,
        device=device,
        compute_share=compute_share,
        send_share=min(1.0, send / elapsed),
        idle_share=1.0 - compute_share,
        requests_per_s=computed / elapsed,
        mean_compute_ms=compute / computed * 1e3 if computed else None,
        mean_send_ms=send / sent * 1e3 if sent else None,
        sent_mb_per_s=max(0.0, now.bytes_out - before.bytes_out) / elapsed / 1e6,
        **gauges,
    )


@dataclass(frozen=True)
class StageTarget:
    """A stage to scrape: its index in the chain, its device and how to fetch its metrics."""

    index: int
    device: str
    fetch: Callable[[], str]


class StageSampler:
    """Scrapes stages and turns consecutive scrapes of each device into rates."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._last: dict[str, Counters] = {}
        self._lock = threading.Lock()

    def sample(self, targets: Sequence[StageTarget]) -> list[StageRates]:
        """One scrape of every target (in parallel); a stage that fails carries its error."""
        if not targets:
            return []
        with ThreadPoolExecutor(max_workers=len(targets)) as pool:
            return list(pool.map(self._one, targets))

    def last(self, device: str) -> Counters | None:
        """The latest scrape of ``device`` that could be read."""
        with self._lock:
            return self._last.get(device)

    def _one(self, target: StageTarget) -> StageRates:
        try:
            now = parse_counters(target.fetch(), self._clock())
        except AgentError as exc:
            return StageRates(index=target.index, device=target.device, error=str(exc))
        except ValueError as exc:
            message = f"{target.device} sent metrics the console cannot read: {exc}"
            return StageRates(index=target.index, device=target.device, error=message)
        with self._lock:
            before = self._last.get(target.device)
            self._last[target.device] = now
        return rates(target.index, target.device, before, now)
