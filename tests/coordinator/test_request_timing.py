"""The coordinator's one request timer: each HTTP request timed once, for every observer.

In process (FastAPI's TestClient): what the observers get for a plain answer, a streamed one, a
404 and a route that raises, and that the start hooks run before the route sees its scope.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from coordinator.console.stats import InferenceCounter, RequestStats
from coordinator.http.timing import RequestTimer, TimedRequest


def _app(seen: list[TimedRequest], also: list[TimedRequest], stats: RequestStats) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/embeddings")
    def embeddings(request: Request) -> dict[str, str]:
        return {"mark": str(request.scope.get("mark"))}

    @app.post("/v1/completions")
    def stream() -> StreamingResponse:
        def chunks() -> Iterator[bytes]:
            yield b"a"
            yield b"b"

        return StreamingResponse(chunks())

    @app.post("/v1/infer")
    def fails() -> None:
        raise RuntimeError("broken route")

    def mark(scope: MutableMapping[str, Any]) -> None:
        scope["mark"] = "started"

    app.add_middleware(
        RequestTimer, observers=[seen.append, also.append, InferenceCounter(stats)], starts=[mark]
    )
    return app


def test_every_observer_gets_the_same_timing_of_each_request() -> None:
    seen: list[TimedRequest] = []
    also: list[TimedRequest] = []
    stats = RequestStats()
    client = TestClient(_app(seen, also, stats), raise_server_exceptions=False)

    assert client.post("/v1/embeddings").json() == {"mark": "started"}
    assert client.post("/v1/completions").content == b"ab"
    assert client.get("/v1/nowhere").status_code == 404
    assert client.post("/v1/infer").status_code == 500

    assert seen == also  # one timing per request, handed to each observer
    got = [(t.scope["path"], t.status, t.done) for t in seen]
    assert got == [
        ("/v1/embeddings", 200, True),
        ("/v1/completions", 200, True),
        ("/v1/nowhere", 404, True),
        ("/v1/infer", 500, False),  # raised before its response: counted, as a failure
    ]
    assert all(t.seconds >= 0 for t in seen)
    snap = stats.snapshot()  # the console counts the three inference POSTs, one failed
    assert (snap.total, snap.errors) == (3, 1)
