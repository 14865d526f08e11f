"""Device liveness: a control-plane ping of every paired agent about once a second.

mDNS alone cannot tell that an agent died: a ``kill -9``'d agent sends no goodbye, and its
records stay cached for minutes. :class:`Liveness` therefore asks each trusted agent for its
``GET /v1/status`` every :attr:`~coordinator.config.Retries.ping_interval_s` with a short
timeout (:attr:`~coordinator.config.Timeouts.ping_s`) and decides:

- **lost** after :attr:`~coordinator.config.Retries.ping_misses` failed pings in a row
  (timeouts: a busy agent may answer late; after a miss the next round starts at once, so a
  silent device, such as one behind a cut link, is lost about ``ping_interval_s +
  ping_misses * ping_s`` after it went quiet). A device the coordinator is pushing a segment
  to right now (``busy``) is loading it and may not answer for seconds; its timeouts are
  forgiven for up to :attr:`~coordinator.config.Timeouts.busy_grace_s`;
  at once when its port refuses the connection (nothing listens: the process is gone), when a
  caller's own evidence (a broken chain) is confirmed by a failed :meth:`Liveness.probe`, when
  the device leaves the trusted set (mDNS goodbye, revocation), or when a device the
  deployments expect has not shown up
  :attr:`~coordinator.config.Timeouts.startup_grace_s` after start;
- **back** once a lost device has answered every ping for
  :attr:`~coordinator.config.Timeouts.settle_s` (no flapping).

Events go to a :class:`LivenessListener` (the failover policy), outside any lock. The status
replies are handed on too, so the listener can see an agent that answers but no longer holds
its segment (it restarted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from coordinator.config import Retries, Timeouts
from coordinator.errors import AgentError
from coordinator.fleet.registry import DeviceRecord
from protocols.deploy import AgentStatus

log = logging.getLogger(__name__)

Ping = Callable[[DeviceRecord, float], AgentStatus]
"""``GET /v1/status`` of a device with a timeout in seconds; raises AgentError."""


class LivenessListener(Protocol):
    """Who is told about lost and returning devices."""

    def device_lost(self, name: str, reason: str) -> None:
        """``name`` stopped answering (or left)."""
        ...

    def device_back(self, name: str) -> None:
        """``name`` has answered steadily again for the settle time."""
        ...

    def device_status(self, name: str, status: AgentStatus, asked_at: float) -> None:
        """A status reply; ``asked_at`` is wall-clock time when the ping was sent."""
        ...


@dataclass(frozen=True)
class _Reply:
    status: AgentStatus | None
    error: str
    refused: bool
    """The connection was refused: nothing listens on the port any more."""
    asked_at: float
    """Wall-clock time the ping was sent."""


@dataclass
class _Device:
    state: str = "alive"
    """``alive``, ``lost`` or ``returning``."""
    misses: int = 0
    since: float = 0.0
    """When it started returning (monotonic)."""
    quiet_since: float = 0.0
    """When its current run of missed pings began (monotonic)."""


class Liveness:
    """Pings trusted agents and tells the listener who is lost and who is back."""

    def __init__(
        self,
        devices: Callable[[], list[DeviceRecord]],
        expected: Callable[[], Collection[str]],
        ping: Ping,
        listener: LivenessListener,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        busy: Callable[[], Collection[str]] = frozenset,
        timeouts: Timeouts | None = None,
        retries: Retries | None = None,
    ) -> None:
        self._timeouts = timeouts or Timeouts()
        self._retries = retries or Retries()
        self._devices = devices
        self._busy = busy
        self._expected = expected
        self._ping = ping
        self._listener = listener
        self._clock = clock
        self._wall = wall
        self._started = clock()
        self._known: dict[str, _Device] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ping")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def alive(self, name: str) -> bool:
        """Whether ``name`` may be planned on: not lost, not still settling after a return."""
        with self._lock:
            device = self._known.get(name)
        return device is None or device.state == "alive"

    def tick(self) -> None:
        """One round: ping every trusted device, judge the ones that are gone."""
        records = {r.name: r for r in self._devices()}
        replies = self._ping_all(list(records.values()))
        busy = set(self._busy())
        events: list[tuple[str, str, str]] = []
        with self._lock:
            for name, reply in replies.items():
                events += self._judge(name, reply, decisive=False, patient=name in busy)
            events += self._judge_absent(set(records))
        self._emit(events, replies)

    def probe(self, names: Collection[str]) -> dict[str, AgentStatus | None]:
        """Ping ``names`` now (a chain through them failed); a failed ping counts as lost.

        Returns each name's status, or None for a device that is lost or not trusted.
        """
        records = [r for r in self._devices() if r.name in names]
        replies = self._ping_all(records)
        events: list[tuple[str, str, str]] = []
        with self._lock:
            for name, reply in replies.items():
                events += self._judge(name, reply, decisive=True)
            for name in set(names) - set(replies):
                events += self._lose(name, "it is not online or no longer trusted")
            states = {name: self._known[name].state for name in names}
        self._emit(events, replies)
        return {
            name: replies[name].status if name in replies and states[name] == "alive" else None
            for name in names
        }

    def start(self) -> None:
        """Ping in a background thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop pinging."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.wait(self._pause()):
            try:
                self.tick()
            except Exception:  # the monitor must outlive any one bad round
                log.exception("liveness round failed")

    def _pause(self) -> float:
        """The wait before the next round: none while a device not yet lost has just missed."""
        with self._lock:
            suspect = any(d.state == "alive" and d.misses > 0 for d in self._known.values())
        return 0.0 if suspect else self._retries.ping_interval_s

    def _ping_all(self, records: list[DeviceRecord]) -> dict[str, _Reply]:
        def one(record: DeviceRecord) -> _Reply:
            asked = self._wall()
            try:
                return _Reply(self._ping(record, self._timeouts.ping_s), "", False, asked)
            except AgentError as exc:
                refused = isinstance(exc.__cause__, ConnectionRefusedError)
                return _Reply(None, str(exc), refused, asked)

        results = list(self._pool.map(one, records))
        return {r.name: result for r, result in zip(records, results, strict=True)}

    def _judge(
        self, name: str, reply: _Reply, decisive: bool, patient: bool = False
    ) -> list[tuple[str, str, str]]:
        device = self._known.setdefault(name, _Device())
        if reply.status is None:
            if device.misses == 0:
                device.quiet_since = self._clock()
            device.misses += 1
            if device.state == "returning":
                device.state = "lost"
            decisive = decisive or reply.refused
            if device.state == "alive" and (decisive or self._out_of_patience(device, patient)):
                return self._lose(name, f"it stopped answering: {reply.error}")
            return []
        device.misses = 0
        if device.state == "lost":
            device.state, device.since = "returning", self._clock()
        if device.state == "returning" and self._clock() - device.since >= self._timeouts.settle_s:
            device.state = "alive"
            return [("back", name, "")]
        return []

    def _out_of_patience(self, device: _Device, patient: bool) -> bool:
        if not patient:
            return device.misses >= self._retries.ping_misses
        return self._clock() - device.quiet_since >= self._timeouts.busy_grace_s

    def _judge_absent(self, present: set[str]) -> list[tuple[str, str, str]]:
        events = []
        for name, device in self._known.items():
            if name not in present and device.state != "lost":
                events += self._lose(name, "it left (mDNS goodbye) or is no longer trusted")
        if self._clock() - self._started >= self._timeouts.startup_grace_s:
            for name in set(self._expected()) - present - set(self._known):
                events += self._lose(name, "a deployment uses it but it has not come online")
        return events

    def _lose(self, name: str, reason: str) -> list[tuple[str, str, str]]:
        device = self._known.setdefault(name, _Device())
        if device.state == "lost":
            return []
        was_alive = device.state == "alive"
        device.state, device.misses = "lost", max(device.misses, self._retries.ping_misses)
        return [("lost", name, reason)] if was_alive else []

    def _emit(self, events: list[tuple[str, str, str]], replies: dict[str, _Reply]) -> None:
        for kind, name, reason in events:
            if kind == "lost":
                log.warning("device %s lost: %s", name, reason)
                self._listener.device_lost(name, reason)
            else:
                log.warning("device %s is back", name)
                self._listener.device_back(name)
        for name, reply in replies.items():
            if reply.status is not None:
                self._listener.device_status(name, reply.status, reply.asked_at)
