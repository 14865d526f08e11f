"""Failover: when a device of a served model's plan is lost, re-plan on the devices left.

:class:`Failover` is the policy; its inputs are events from :mod:`coordinator.fleet.liveness` (a
device lost, a device back, a status reply) and chain failures reported by the router, and
everything it acts through is injected (the deployment store, a re-plan function, the router's
abort, a probe), so it can be tested with fakes.

- **Lost device.** Every model whose active version uses it becomes *recovering*: the version
  is marked unusable, the requests in flight on its chain are aborted (the router retries them
  on the next version), and a re-plan runs on a worker thread, one at a time.
- **Before the re-plan** the broken version (and the previous one, if it used a lost device)
  is unloaded from the devices left: it cannot serve, and a model that fills its devices
  would not fit beside its own broken copy.
- **Re-plan succeeded.** The new version is active; waiting requests go there.
- **Re-plan failed** (the devices left cannot hold the model): the model is *unavailable* and
  requests get :class:`~coordinator.errors.UnavailableError` (503 with the reason and
  ``Retry-After``) at once. It is tried again when a device comes back, and every
  :attr:`~coordinator.config.Retries.unavailable_s`.
- **Device back** (after liveness's settle time): models re-planned without it, or
  unavailable, are re-planned, so the plan expands again.
- **Segment missing.** An agent that answers but no longer holds its segment of an active
  version (it restarted) counts as lost for that version.

Every decision is kept as a :class:`FailoverEvent` (``GET /v1/failover``).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from coordinator.config import Retries
from coordinator.deploy.store import DeploymentStore, VersionRecord, version_label
from coordinator.errors import CoordinatorError, NotServableError, UnavailableError
from protocols.base import FrozenModel
from protocols.deploy import AgentStatus

log = logging.getLogger(__name__)
MAX_EVENTS = 500

Replan = Callable[[VersionRecord, str], VersionRecord]
"""Deploy the model of a version again on the devices online now, with a reason; the new
active version. Raises CoordinatorError."""
Release = Callable[[VersionRecord, frozenset[str]], None]
"""Free what a version that lost devices still holds on the others (before its re-plan)."""
Probe = Callable[[Collection[str]], Mapping[str, AgentStatus | None]]
"""Ping devices now; each one's status, or None when it is lost."""
EventKind = Literal[
    "lost", "back", "recovering", "replanned", "unavailable", "expanded", "expand_failed"
]


class FailoverEvent(FrozenModel):
    """One thing failover noticed or did."""

    at: float
    """Wall-clock time."""
    kind: EventKind
    device: str | None = None
    model_id: str | None = None
    plan_version: int | None = None
    """The agents' key of the version it concerns (see :mod:`coordinator.deploy.store`)."""
    version: int | None = None
    """That version's number for its model (``MODEL vN``, as every surface shows it)."""
    detail: str = ""


@dataclass(frozen=True)
class Condition:
    """A model that is not served by its active version."""

    state: Literal["recovering", "unavailable"]
    plan_version: int
    """The broken version."""
    lost: frozenset[str]
    reason: str
    since: float
    version: int | None = None
    """The broken version's number for its model (``MODEL vN``)."""
    """Monotonic time of the last change."""


class Failover:
    """The failover policy; also the router's :class:`~coordinator.serving.router.Guard`."""

    def __init__(
        self,
        store: DeploymentStore,
        replan: Replan,
        abort: Callable[[int, str], None],
        probe: Probe,
        *,
        release: Release,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        retries: Retries | None = None,
    ) -> None:
        self._store = store
        self._retry_s = (retries or Retries()).unavailable_s
        """How often an unavailable model is re-planned again without any device returning."""
        self._replan = replan
        self._release = release
        self._released: set[int] = set()
        """Broken versions already released (a re-plan may be tried again)."""
        self._abort = abort
        self._probe = probe
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._broken: set[int] = set()
        self._conditions: dict[str, Condition] = {}
        self._degraded: dict[str, frozenset[str]] = {}
        """Per model, devices lost since its last plan that used every device."""
        self._gone: set[str] = set()
        """Devices lost and not back yet (one that returns mid-re-plan is expanded onto after)."""
        self._jobs: queue.Queue[tuple[str, str]] = queue.Queue()
        self._queued: set[tuple[str, str]] = set()
        self._events: collections.deque[FailoverEvent] = collections.deque(maxlen=MAX_EVENTS)
        self._counts: collections.Counter[str] = collections.Counter()
        """Events so far by kind, never trimmed (the coordinator's ``/metrics``)."""
        self._losses = 0
        """Devices lost so far: a re-plan that fails while another device went away is retried."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the router's guard

    def current(self, model_id: str, deadline: float) -> VersionRecord:
        """The version to send to; waits (until ``deadline``) while the model is re-planned.

        Raises UnavailableError when the devices left cannot hold it, NotServableError when no
        new version is ready by ``deadline``.
        """
        with self._changed:
            while True:
                version = self._store.active(model_id)
                condition = self._conditions.get(model_id)
                if version.plan_version not in self._broken:
                    if condition is not None and condition.plan_version != version.plan_version:
                        del self._conditions[model_id]  # replaced meanwhile (e.g. a deploy)
                    return version
                if condition is None:  # e.g. a rollback onto a version that lost a device
                    reason = f"v{version.version} lost a device earlier"
                    self._begin(version, frozenset(), reason)
                    continue
                if condition.state == "unavailable":
                    raise UnavailableError(self._refusal(model_id, condition), self.retry_after())
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise NotServableError(
                        f"model {model_id!r} is being re-planned ({condition.reason}) and no "
                        "new version was ready in time"
                    )
                self._changed.wait(min(remaining, 1.0))

    def failed(self, version: VersionRecord, error: CoordinatorError) -> None:
        """A request on ``version``'s chain failed: check its devices now.

        A device that does not answer is reported lost by the probe (which starts a re-plan);
        one that answers without its segment counts as lost for this version. If every device
        is fine the failure was transient and the caller simply retries.
        """
        with self._lock:
            if version.plan_version in self._broken:
                return
        statuses = self._probe([p.device for p in version.segments])
        missing = sorted(
            name
            for name, status in statuses.items()
            if status is not None and not holds(status, version.plan_version)
        )
        if missing:
            reason = f"{', '.join(missing)} no longer hold their segments (restarted?)"
            self._lose([version], missing[0], reason)
        else:
            log.info("chain of %s failed, its devices answer: %s", version_label(version), error)

    def usable(self, plan_version: int) -> bool:
        """Whether requests may still go to this plan version's chain."""
        with self._lock:
            return plan_version not in self._broken

    # ------------------------------------------------------------------ liveness events

    def device_lost(self, name: str, reason: str) -> None:
        """``name`` is gone: re-plan every model whose active version uses it."""
        self._record("lost", device=name, detail=reason)
        with self._lock:
            self._losses += 1
            self._gone.add(name)
        affected = [v for v in self._active_versions() if name in _devices(v)]
        self._lose(affected, name, f"device {name} was lost ({reason})")

    def device_back(self, name: str) -> None:
        """``name`` answers steadily again: expand the plans that lost it, retry unavailable."""
        self._record("back", device=name)
        with self._lock:
            self._gone.discard(name)
            for model_id, condition in self._conditions.items():
                if condition.state == "unavailable":
                    self._enqueue("recover", model_id)
            for model_id, lost in self._degraded.items():
                if name in lost:
                    self._enqueue("expand", model_id)

    def device_status(self, name: str, status: AgentStatus, asked_at: float) -> None:
        """A device answered: it must still hold its segment of every active version on it."""
        for version in self._active_versions():
            if name not in _devices(version) or asked_at <= version.created_at:
                continue  # the version is younger than the question
            if not holds(status, version.plan_version) and self.usable(version.plan_version):
                self._lose([version], name, f"device {name} no longer holds its segment")

    # ------------------------------------------------------------------ state and the worker

    def events(self) -> list[FailoverEvent]:
        """What failover noticed and did, oldest first (the last :data:`MAX_EVENTS`)."""
        with self._lock:
            return list(self._events)

    def event_counts(self) -> dict[str, int]:
        """How many events of each kind happened since start (not only the last ones kept)."""
        with self._lock:
            return dict(self._counts)

    def conditions(self) -> dict[str, Condition]:
        """Models that are being re-planned or cannot be served now."""
        with self._lock:
            return dict(self._conditions)

    def expected_devices(self) -> set[str]:
        """Devices the active versions run on (liveness watches for them at start)."""
        return {name for version in self._active_versions() for name in _devices(version)}

    def retry_after(self) -> float:
        """Seconds a refused caller should wait before trying again."""
        return self._retry_s

    def start(self) -> None:
        """Run re-plans on a worker thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="failover", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the worker (a re-plan under way finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)

    def run_pending(self) -> int:
        """Run the queued re-plans now, in this thread; how many ran."""
        ran = 0
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return ran
            self._run_job(job)
            ran += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.5)
            except queue.Empty:
                self._retry_unavailable()
                continue
            self._run_job(job)

    def _run_job(self, job: tuple[str, str]) -> None:
        with self._lock:
            self._queued.discard(job)
        kind, model_id = job
        try:
            if kind == "recover":
                self._recover(model_id)
            else:
                self._expand(model_id)
        except Exception as exc:  # keep the worker alive; the model is refused, not hung
            log.exception("failover %s of %s failed", kind, model_id)
            self._give_up(model_id, f"internal error while re-planning: {exc}")

    def _retry_unavailable(self) -> None:
        now = self._clock()
        with self._lock:
            for model_id, condition in self._conditions.items():
                if condition.state == "unavailable" and now - condition.since >= self._retry_s:
                    self._enqueue("recover", model_id)

    def _recover(self, model_id: str) -> None:
        with self._lock:
            condition = self._conditions.get(model_id)
        if condition is None:
            return
        broken = self._store.model(model_id).by_plan(condition.plan_version)
        if broken is None or self._store.active(model_id).plan_version != broken.plan_version:
            self._settle(model_id, None, condition.lost)  # someone deployed meanwhile
            return
        with self._lock:
            losses = self._losses
        if broken.plan_version not in self._released:
            self._released.add(broken.plan_version)
            self._release(broken, condition.lost)
        try:
            version = self._replan(broken, f"failover: {condition.reason}")
        except CoordinatorError as exc:
            with self._lock:
                again = self._losses != losses and condition.state == "recovering"
                if again:  # a device of the new plan may have gone meanwhile: plan once more
                    self._enqueue("recover", model_id)
            if not again:
                reason = f"{condition.reason}; the devices left cannot serve it: {exc}"
                self._give_up(model_id, reason)
            return
        self._settle(model_id, version, condition.lost, recovered=True)
        self._record("replanned", model_id, version, ", ".join(_devices(version)))

    def _expand(self, model_id: str) -> None:
        version = self._store.active(model_id)
        if not self.usable(version.plan_version):
            return
        with self._lock:
            lost = self._degraded.get(model_id, frozenset())
        try:
            new = self._replan(version, f"expand: {', '.join(sorted(lost))} returned")
        except CoordinatorError as exc:
            log.warning("could not expand %s again: %s", model_id, exc)
            self._record("expand_failed", model_id, version, str(exc))
            return
        self._settle(model_id, new, frozenset())
        self._record("expanded", model_id, new, ", ".join(_devices(new)))

    def _settle(
        self,
        model_id: str,
        version: VersionRecord | None,
        lost: frozenset[str],
        *,
        recovered: bool = False,
    ) -> None:
        with self._changed:
            self._conditions.pop(model_id, None)
            if version is not None:
                missing = (self._degraded.get(model_id, frozenset()) | lost) - set(
                    _devices(version)
                )
                self._degraded[model_id] = frozenset(missing)
                if recovered and missing - self._gone:  # back while the re-plan ran without it
                    self._enqueue("expand", model_id)
            self._changed.notify_all()

    def _give_up(self, model_id: str, reason: str) -> None:
        with self._changed:
            condition = self._conditions.get(model_id)
            if condition is None:
                return
            self._conditions[model_id] = replace(
                condition, state="unavailable", reason=reason, since=self._clock()
            )
            self._changed.notify_all()
        log.warning("model %s cannot be served: %s", model_id, reason)
        self._record("unavailable", model_id, None, reason)

    def _lose(self, versions: list[VersionRecord], device: str, reason: str) -> None:
        begun = []
        with self._changed:
            for version in versions:
                condition = self._conditions.get(version.model_id)
                if version.plan_version not in self._broken:
                    self._begin(version, frozenset({device}), reason)
                    begun.append(version)
                elif condition is not None and condition.plan_version == version.plan_version:
                    self._conditions[version.model_id] = replace(
                        condition, lost=condition.lost | {device}
                    )
        for version in begun:  # outside the lock: the router takes its own lock here
            self._record("recovering", version.model_id, version, reason)
            self._abort(version.plan_version, f"v{version.version}: {reason}")

    def _begin(self, version: VersionRecord, lost: frozenset[str], reason: str) -> None:
        """Mark ``version`` broken and queue its re-plan (the caller holds the lock)."""
        self._broken.add(version.plan_version)
        self._conditions[version.model_id] = Condition(
            "recovering", version.plan_version, lost, reason, self._clock(), version.version
        )
        self._enqueue("recover", version.model_id)
        self._changed.notify_all()

    def _enqueue(self, kind: str, model_id: str) -> None:
        """Queue a job once (the caller holds the lock)."""
        if (kind, model_id) not in self._queued:
            self._queued.add((kind, model_id))
            self._jobs.put((kind, model_id))

    def _active_versions(self) -> list[VersionRecord]:
        book = self._store.book()
        active = [m.version(m.active) for m in book.models if m.active is not None]
        return [v for v in active if v is not None]

    def _refusal(self, model_id: str, condition: Condition) -> str:
        return f"model {model_id!r} cannot be served now: {condition.reason}"

    def _record(
        self,
        kind: EventKind,
        model_id: str | None = None,
        version: VersionRecord | None = None,
        detail: str = "",
        device: str | None = None,
    ) -> None:
        event = FailoverEvent(
            at=self._wall(),
            kind=kind,
            device=device,
            model_id=model_id,
            plan_version=version.plan_version if version is not None else None,
            version=version.version if version is not None else None,
            detail=detail,
        )
        with self._lock:
            self._events.append(event)
            self._counts[kind] += 1


def holds(status: AgentStatus, plan_version: int) -> bool:
    """Whether an agent's status shows a segment of ``plan_version``."""
    return any(s.report.plan_version == plan_version for s in status.segments)


def _devices(version: VersionRecord) -> list[str]:
    return [p.device for p in version.segments]
