"""The coordinator's Prometheus metrics, served at ``GET /metrics`` (bearer token).

The coordinator is the one place that sees every request, so it counts them here, in its own
registry (the agents' ``/metrics`` count per stage; see the README):

- ``fedshard_coordinator_requests_total{route,method,status}``: every HTTP request, by route
  template (``/v1/models/{model_id}``, never the raw path; ``unmatched`` for none);
- ``fedshard_coordinator_request_duration_seconds{route,model}``: latency until a response's
  last byte (a streamed answer counts until its final token), per model for the routes that
  name one (``model`` is empty before the model is known to exist, so request bodies never
  mint label values);
- ``fedshard_coordinator_generated_tokens_total{model}`` and
  ``fedshard_coordinator_input_tokens_total{model}``: completion tokens generated, and prompt
  or embedded tokens read;
- ``fedshard_coordinator_generation_sessions{model}``: generations holding a session now;
- ``fedshard_coordinator_devices{status,online}``: devices by pairing status and liveness;
- ``fedshard_coordinator_failover_events_total{kind}``: failover's decisions (``recovering`` is
  a failover begun, ``replanned`` one that succeeded, ``unavailable`` one that could not);
- ``fedshard_coordinator_training_rounds_total``: federated rounds finished, over every run.

The last three are read from their owners at scrape time (:class:`FleetCollector`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

from fastapi import FastAPI, Request, Response, params
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import Scope

from coordinator.http.devices import device_status
from coordinator.http.timing import TimedRequest

if TYPE_CHECKING:
    from coordinator.http.app import Services

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
NOTES_KEY: Final = "fedshard.metrics"
"""The scope key of a request's :class:`RequestNotes`."""
BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
UNMATCHED: Final = "unmatched"

Event = TypeVar("Event")


@dataclass
class RequestNotes:
    """What a route tells the meter about its request (the model it serves)."""

    model: str = ""


def notes(request: Request) -> RequestNotes:
    """The request's notes (a throwaway when no meter is installed)."""
    found = request.scope.get(NOTES_KEY)
    return found if isinstance(found, RequestNotes) else RequestNotes()


@dataclass(frozen=True)
class FleetSources:
    """Where the scrape-time metrics come from (each absent when the app has no such part)."""

    devices: Callable[[], Iterable[tuple[str, bool]]]
    """Every known device's ``(status, online)``."""
    failover_events: Callable[[], Mapping[str, int]] | None = None
    """Failover events so far, by kind."""
    training_rounds: Callable[[], int] | None = None
    """Rounds finished so far, over every training run."""


class FleetCollector(Collector):
    """Devices by state, failover events and training rounds, read when scraped."""

    def __init__(self, sources: FleetSources) -> None:
        """Read from ``sources`` on every scrape."""
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        """The current values."""
        devices = GaugeMetricFamily(
            "fedshard_coordinator_devices",
            "Devices the coordinator knows, by pairing status and liveness",
            labels=["status", "online"],
        )
        counts: dict[tuple[str, str], int] = {}
        for status, online in self._sources.devices():
            key = (status, "true" if online else "false")
            counts[key] = counts.get(key, 0) + 1
        for key, count in sorted(counts.items()):
            devices.add_metric(list(key), count)
        yield devices
        failovers = CounterMetricFamily(
            "fedshard_coordinator_failover_events",
            "Failover events by kind (recovering: a failover begun; replanned: it succeeded)",
            labels=["kind"],
        )
        if self._sources.failover_events is not None:
            for kind, count in sorted(self._sources.failover_events().items()):
                failovers.add_metric([kind], count)
        yield failovers
        rounds = self._sources.training_rounds
        yield CounterMetricFamily(
            "fedshard_coordinator_training_rounds",
            "Federated fine-tuning rounds finished, over every run",
            value=rounds() if rounds is not None else 0,
        )


class CoordinatorMetrics:
    """The coordinator's metrics, in their own registry; one instance per app."""

    def __init__(self) -> None:
        """Empty counters."""
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "fedshard_coordinator_requests",
            "HTTP requests by route template, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "fedshard_coordinator_request_duration_seconds",
            "Time from a request's arrival to its response's last byte, by route and model",
            ["route", "model"],
            registry=r,
            buckets=BUCKETS,
        )
        self.generated_tokens = Counter(
            "fedshard_coordinator_generated_tokens",
            "Completion tokens generated",
            ["model"],
            registry=r,
        )
        self.input_tokens = Counter(
            "fedshard_coordinator_input_tokens",
            "Prompt tokens read (generation) and tokens embedded",
            ["model"],
            registry=r,
        )
        self.sessions = Gauge(
            "fedshard_coordinator_generation_sessions",
            "Generations holding a session on the model's chain now",
            ["model"],
            registry=r,
        )

    def watch(self, sources: FleetSources) -> None:
        """Also report devices, failovers and training rounds, read from ``sources``."""
        self.registry.register(FleetCollector(sources))

    def render(self) -> bytes:
        """Prometheus text exposition format."""
        return generate_latest(self.registry)

    def record(self, route: str, method: str, status: int, model: str, seconds: float) -> None:
        """Count one finished request."""
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, model).observe(seconds)

    async def generation(
        self, model: str, events: AsyncIterator[Event], usage_of: Callable[[Event], Any]
    ) -> AsyncGenerator[Event, None]:
        """``events`` of one generation, counted: a session is open from its first event until
        the generation is closed; ``usage_of(event)`` is the final usage, or None."""
        gauge = self.sessions.labels(model)
        gauge.inc()
        try:
            async for event in events:
                usage = usage_of(event)
                if usage is not None:
                    self.input_tokens.labels(model).inc(usage.prompt_tokens)
                    self.generated_tokens.labels(model).inc(usage.completion_tokens)
                yield event
        finally:
            gauge.dec()
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()


def route_template(scope: Scope) -> str:
    """The matched route's template (``/v1/models/{model_id}``), from the path and its path
    parameters; :data:`UNMATCHED` when no route matched."""
    if scope.get("endpoint") is None:
        return UNMATCHED
    segments = str(scope["path"]).split("/")
    for name, value in dict(scope.get("path_params") or {}).items():
        for i in range(len(segments) - 1, 0, -1):
            if segments[i] == str(value):
                segments[i] = "{" + name + "}"
                break
    return "/".join(segments)


class RequestMeter:
    """Counts and times every HTTP request into :class:`CoordinatorMetrics`: a start hook and
    an observer of the one :class:`~coordinator.http.timing.RequestTimer`."""

    def __init__(self, metrics: CoordinatorMetrics) -> None:
        """Count into ``metrics``."""
        self.metrics = metrics

    def start(self, scope: Scope) -> None:
        """Leave fresh :class:`RequestNotes` in the request's scope for its route to fill."""
        scope[NOTES_KEY] = RequestNotes()

    def __call__(self, request: TimedRequest) -> None:
        """Record one finished request."""
        scope = request.scope
        found = scope.get(NOTES_KEY)
        model = found.model if isinstance(found, RequestNotes) and request.status != 404 else ""
        route, method = route_template(scope), scope["method"]
        self.metrics.record(route, method, request.status, model, request.seconds)


def mount_metrics(app: FastAPI, services: Services, token: params.Depends) -> CoordinatorMetrics:
    """``GET /metrics`` (behind ``token``, like every API route); the meter is a
    :class:`RequestMeter` on the app's :class:`~coordinator.http.timing.RequestTimer`."""
    metrics = CoordinatorMetrics()

    def devices() -> list[tuple[str, bool]]:
        book = services.pairing.book()
        return [
            (device_status(book, r.name, r.fingerprint, r.impostor_of), r.online)
            for r in services.registry.devices(online_only=False)
        ]

    failover = services.serving.failover if services.serving is not None else None
    training = services.training
    metrics.watch(
        FleetSources(
            devices=devices,
            failover_events=failover.event_counts if failover is not None else None,
            training_rounds=(
                (lambda: sum(len(run.rounds) for run in training.list()))
                if training is not None
                else None
            ),
        )
    )

    @app.get("/metrics", dependencies=[token], include_in_schema=False)
    def scrape() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return metrics
