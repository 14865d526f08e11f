"""Reading a coordinator's deployments and failover events, for the failover tests.

Shared by ``tests/e2e/test_failover.py`` (coordinator on 127.0.0.1) and
``tests/lab/test_lab_failover.py`` (coordinator in the LAN lab): each passes its own ``get``, a
function from an API path to the JSON body of ``GET path``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Get = Callable[[str], Any]
"""``GET path`` on the coordinator's API; the JSON body."""


def active_version(get: Get, model_id: str) -> dict[str, Any]:
    """The active version of ``model_id`` in ``GET /v1/deployments``."""
    [record] = [m for m in get("/v1/deployments") if m["model_id"] == model_id]
    active: dict[str, Any] = next(v for v in record["versions"] if v["version"] == record["active"])
    return active


def segment_devices(version: dict[str, Any]) -> list[str]:
    """The devices of a version's segments, in the order the version lists them."""
    return [p["device"] for p in version["segments"]]


def failover_events(get: Get) -> list[dict[str, Any]]:
    """The events in ``GET /v1/failover``, as the coordinator lists them."""
    events: list[dict[str, Any]] = get("/v1/failover")["events"]
    return events
