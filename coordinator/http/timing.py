"""The one request-timing middleware: every HTTP request timed once, for every observer.

:class:`RequestTimer` wraps the whole app (outside the token and size guard, so refused
requests are timed too). Before the request goes in, each ``start`` hook may note things in its
scope (the Prometheus meter leaves a :class:`~coordinator.http.metrics.RequestNotes` there);
when the response has ended, or the application raised, each observer gets one
:class:`TimedRequest`: the Prometheus meter (:class:`~coordinator.http.metrics.RequestMeter`)
and the console's inference counters (:class:`~coordinator.console.stats.InferenceCounter`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send


@dataclass(frozen=True)
class TimedRequest:
    """One finished HTTP request, as the timer saw it."""

    scope: Scope
    status: int
    """The response's status; 500 when the application raised before starting one."""
    done: bool
    """Whether the response's last body message went out (a streamed answer: its last token)."""
    seconds: float
    """From arrival until the response ended, or until the application raised."""


Observer = Callable[[TimedRequest], Any]
StartHook = Callable[[Scope], Any]


class RequestTimer:
    """ASGI middleware: times each HTTP request from arrival until the last byte of its
    response, however it ends, and hands it to ``observers`` in order."""

    def __init__(
        self,
        app: ASGIApp,
        observers: Sequence[Observer],
        starts: Sequence[StartHook] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Wrap ``app``; ``starts`` run on each request's scope before it goes in."""
        self.app = app
        self.observers = tuple(observers)
        self.starts = tuple(starts)
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request through; report it when its response ends, however it ends."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = self.clock()
        for start in self.starts:
            start(scope)
        state = {"status": 500, "done": False}

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                state["done"] = True

        try:
            await self.app(scope, receive, timed_send)
        finally:
            timed = TimedRequest(
                scope, int(state["status"]), bool(state["done"]), self.clock() - started
            )
            for observer in self.observers:
                observer(timed)
