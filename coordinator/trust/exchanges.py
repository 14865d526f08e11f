"""Background exchanges with agents for pairing and revocation, each on its own task.

mDNS only *suggests* hosts, so the pairing poller must never wait for one of them: a host that
drips its answer must not hold back anyone else's offer, grant or revocation. Each exchange
runs in its own worker under its own deadline (the transport's), its result is handled the
moment it completes (the ``done`` callback, in that worker), and it is tracked until then:

- at most one exchange per endpoint (host, port) at a time, and at most :data:`MAX_IN_FLIGHT`
  in all (a round that finds no room asks again next round);
- an endpoint whose exchange failed (refused, dripped past its deadline, an unreadable answer)
  is not asked again for :attr:`~coordinator.config.Retries.exchange_retry_s`, doubling with
  each failure in a row up to :attr:`~coordinator.config.Retries.exchange_max_backoff_s`; an
  answer resets it;
- :meth:`Exchanges.close` cancels what has not started and waits for what has (each within its
  deadline): nothing is left running.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from coordinator.config import Retries
from coordinator.errors import AgentError

log = logging.getLogger(__name__)
MAX_IN_FLIGHT = 64
MAX_BACKOFFS = 4096
"""Endpoints remembered as backing off; past that, the ones whose backoff ended are dropped."""
Endpoint = tuple[str, int]
T = TypeVar("T")


@dataclass(frozen=True)
class _Backoff:
    until: float
    delay: float


class Exchanges:
    """Tracked exchanges, one per endpoint, with per-endpoint backoff after failures."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, retries: Retries | None = None
    ) -> None:
        self._clock = clock
        self._retries = retries or Retries()
        self._pool = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="trust-exchange")
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight: dict[Endpoint, Future[Any]] = {}
        self._backoff: dict[Endpoint, _Backoff] = {}
        self._closed = False

    def start(
        self,
        endpoint: Endpoint,
        call: Callable[[], T],
        done: Callable[[T | AgentError], None],
    ) -> bool:
        """Run ``call`` in its own worker and hand its result (or AgentError) to ``done``.

        Returns False, starting nothing, while ``endpoint`` has an exchange in flight or backs
        off, or while :data:`MAX_IN_FLIGHT` are running.
        """
        with self._lock:
            if self._closed or not self._ready(endpoint):
                return False
            if len(self._in_flight) >= MAX_IN_FLIGHT:
                return False
            future = self._pool.submit(call)
            self._in_flight[endpoint] = future
        future.add_done_callback(partial(self._finish, endpoint, done))
        return True

    def ready(self, endpoint: Endpoint) -> bool:
        """Whether an exchange with ``endpoint`` could start now."""
        with self._lock:
            return self._ready(endpoint)

    def in_flight(self) -> int:
        """Exchanges running now."""
        with self._lock:
            return len(self._in_flight)

    def wait_idle(self, timeout: float, endpoints: Collection[Endpoint] | None = None) -> bool:
        """Wait until no exchange with ``endpoints`` (or none at all) is in flight."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                busy = self._in_flight.keys() if endpoints is None else set(endpoints)
                if not any(e in self._in_flight for e in busy):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)

    def close(self) -> None:
        """Cancel exchanges not yet started; wait for the running ones (their deadlines)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _ready(self, endpoint: Endpoint) -> bool:
        backoff = self._backoff.get(endpoint)
        waiting = backoff is not None and backoff.until > self._clock()
        return endpoint not in self._in_flight and not waiting

    def _finish(
        self,
        endpoint: Endpoint,
        done: Callable[[T | AgentError], None],
        future: Future[T],
    ) -> None:
        try:
            result = future.result()
        except CancelledError:  # closed before it started
            pass
        except AgentError as exc:
            self._settle(endpoint, failed=True)
            done(exc)
        except Exception:  # a bug in an exchange: logged, and the endpoint backs off
            self._settle(endpoint, failed=True)
            log.exception("an exchange with %s:%d failed", *endpoint)
        else:
            self._settle(endpoint, failed=False)
            done(result)
        finally:
            with self._lock:
                self._in_flight.pop(endpoint, None)
                self._idle.notify_all()

    def _settle(self, endpoint: Endpoint, failed: bool) -> None:
        with self._lock:
            if not failed:
                self._backoff.pop(endpoint, None)
                return
            now = self._clock()
            if len(self._backoff) >= MAX_BACKOFFS:
                self._backoff = {e: b for e, b in self._backoff.items() if b.until > now}
            previous = self._backoff.get(endpoint)
            first, most = self._retries.exchange_retry_s, self._retries.exchange_max_backoff_s
            delay = first if previous is None else min(2 * previous.delay, most)
            self._backoff[endpoint] = _Backoff(now + delay, delay)
