"""The HTTP client that lab tests and benchmarks run inside the coordinator's namespace.

A LAN lab (``devtools.lab``) has no route to the machine's own namespace, so every call to a
coordinator in the lab comes from a process inside its host. :mod:`lab_helpers` starts this file
there as a script; it needs only the standard library::

    python tests/lab_client.py HOST PORT TOKEN serve
    python tests/lab_client.py HOST PORT TOKEN stream TIMEOUT TOTAL IN_FLIGHT MODEL TEXTS_JSON

``serve`` answers one JSON command per stdin line with one JSON line: ``{"op": "relay",
"method", "path", "headers", "body", "timeout"}`` relays one HTTP request (body base64) on a
fresh connection and answers ``{"status", "headers", "body"}`` (status 0: no connection, with
``error``): the transport of the typed client :class:`coordinator.client.CoordinatorClient`
that ``lab_helpers.LabApi`` runs outside the lab; ``{"op": "load", "path", "body", "total",
"in_flight", "timeout"}`` times ``total`` POSTs (``{"latencies", "errors", "wall_s"}``).

``stream`` sends ``TOTAL`` embedding requests for ``MODEL``, ``IN_FLIGHT`` at a time, request
``i`` for text ``i % len(TEXTS)``, each on a fresh connection, and prints one JSON line per answer
as it arrives: ``{"i", "status", "version", "embedding"}`` or ``{..., "detail"}``.
"""

from __future__ import annotations

import base64
import http.client
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


def _call(conn: http.client.HTTPConnection, method: str, path: str, body: Any, token: str) -> Any:
    headers = {"Authorization": "Bearer " + token, "Content-Type": "application/json"}
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=headers)
    reply = conn.getresponse()
    raw = reply.read()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode(errors="replace")
    return reply.status, {k.lower(): v for k, v in reply.getheaders()}, parsed


def one_call(host: str, port: int, token: str, ask: dict[str, Any]) -> dict[str, Any]:
    """One API call on a fresh connection (no keep-alive that the server may close under us)."""
    conn = http.client.HTTPConnection(host, port, timeout=float(ask.get("timeout", 60.0)))
    try:
        status, headers, body = _call(conn, ask["method"], ask["path"], ask.get("body"), token)
    except (OSError, http.client.HTTPException) as exc:
        return {"status": 0, "headers": {}, "body": repr(exc)}
    finally:
        conn.close()
    return {"status": status, "headers": headers, "body": body}


def relay(host: str, port: int, ask: dict[str, Any]) -> dict[str, Any]:
    """One HTTP request as the client outside made it (headers, token and body included), on a
    fresh connection; the answer's status, headers and body (base64) as they came."""
    conn = http.client.HTTPConnection(host, port, timeout=float(ask.get("timeout", 60.0)))
    try:
        body = base64.b64decode(ask["body"]) if ask.get("body") else None
        conn.request(ask["method"], ask["path"], body=body, headers=ask.get("headers", {}))
        reply = conn.getresponse()
        raw = reply.read()
    except (OSError, http.client.HTTPException) as exc:
        return {"status": 0, "error": repr(exc)}
    finally:
        conn.close()
    headers = [[k, v] for k, v in reply.getheaders()]
    return {"status": reply.status, "headers": headers, "body": base64.b64encode(raw).decode()}


def _in_threads(worker: Callable[[], None], count: int) -> None:
    threads = [threading.Thread(target=worker) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def load(host: str, port: int, token: str, ask: dict[str, Any]) -> dict[str, Any]:
    """``total`` POSTs of one body, ``in_flight`` threads each with its own keep-alive
    connection; per-request latency from send to answer, and the wall time of the whole run."""
    total, in_flight = int(ask["total"]), int(ask["in_flight"])
    timeout = float(ask.get("timeout", 60.0))
    lock = threading.Lock()
    issued = [0]
    latencies: list[float] = []
    errors: list[str] = []

    def worker() -> None:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        while True:
            with lock:
                if issued[0] >= total:
                    break
                issued[0] += 1
            start = time.perf_counter()
            try:
                status, _, body = _call(conn, "POST", ask["path"], ask["body"], token)
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
                status, body = 0, repr(exc)
            took = time.perf_counter() - start
            with lock:
                if status == 200:
                    latencies.append(took)
                else:
                    errors.append(f"{status}: {str(body)[:300]}")
        conn.close()

    started = time.perf_counter()
    _in_threads(worker, in_flight)
    return {"latencies": latencies, "errors": errors, "wall_s": time.perf_counter() - started}


def serve(host: str, port: int, token: str) -> None:
    """One JSON command per stdin line, one JSON answer per stdout line."""
    for line in sys.stdin:
        ask = json.loads(line)
        answer = load(host, port, token, ask) if ask["op"] == "load" else relay(host, port, ask)
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


def stream(
    host: str,
    port: int,
    token: str,
    timeout: float,
    total: int,
    in_flight: int,
    model: str,
    texts: Sequence[str],
) -> None:
    """``total`` embedding requests, ``in_flight`` at a time; one JSON line per answer."""
    lock = threading.Lock()
    todo = iter(range(total))

    def worker() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            body = {"model": model, "input": texts[i % len(texts)]}
            ask = {"method": "POST", "path": "/v1/embeddings", "body": body, "timeout": timeout}
            reply = one_call(host, port, token, ask)
            out = {"i": i, "status": reply["status"]}
            out["version"] = reply["headers"].get("x-fedshard-plan-version")
            if reply["status"] == 200:
                out["embedding"] = reply["body"]["data"][0]["embedding"]
            else:
                out["detail"] = reply["body"]
            with lock:
                sys.stdout.write(json.dumps(out) + "\n")
                sys.stdout.flush()

    _in_threads(worker, in_flight)


def main(argv: Sequence[str]) -> int:
    """``HOST PORT TOKEN serve`` or ``HOST PORT TOKEN stream TIMEOUT TOTAL IN_FLIGHT MODEL
    TEXTS_JSON``; 2 on a usage error."""
    if len(argv) == 4 and argv[3] == "serve":
        serve(argv[0], int(argv[1]), argv[2])
        return 0
    if len(argv) == 9 and argv[3] == "stream":
        timeout, total, in_flight = float(argv[4]), int(argv[5]), int(argv[6])
        stream(
            argv[0], int(argv[1]), argv[2], timeout, total, in_flight, argv[7], json.loads(argv[8])
        )
        return 0
    sys.stderr.write(__doc__ or "")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
