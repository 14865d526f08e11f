"""One typed client of the coordinator's own HTTP API (httpx), for the CLI, the demo and tests.

Every call sends the bearer token (when there is one), ignores proxy settings from the
environment (``trust_env=False``: the coordinator is on loopback or the LAN) and takes its
timeout from the call or the client.

- :meth:`CoordinatorClient.call` is one request: a :class:`Reply` with the status and the JSON
  body (a body that is no JSON comes back as ``{"detail": text}``); a transport failure raises
  :class:`httpx.HTTPError`, so that a caller that retries can tell it from an answer.
- The typed methods return the API's own models (``DeviceView`` and the pairing replies of
  :mod:`coordinator.http.device_models`, :class:`~coordinator.deploy.store.VersionRecord`)
  and raise :class:`~coordinator.errors.ApiError` for anything but a 200, a transport failure
  included (status 0).

This module needs the coordinator extra (httpx, and the models' own imports): an entry point
that must stay light on an agent-only install imports it where it is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import TypeAdapter

from coordinator.config import API_DEPLOY_TIMEOUT_S, API_TIMEOUT_S
from coordinator.deploy.store import VersionRecord
from coordinator.errors import ApiError
from coordinator.http.device_models import (
    ApproveBody,
    Approved,
    DeviceView,
    RevokeBody,
    Revoked,
)

_DEVICES = TypeAdapter(list[DeviceView])


@dataclass(frozen=True)
class Reply:
    """One answer of the API: its status and its JSON body."""

    status: int
    body: Any

    @property
    def detail(self) -> Any:
        """The body's ``detail`` (an error's message), or None."""
        return self.body.get("detail") if isinstance(self.body, dict) else None

    def expect(self) -> Any:
        """The body of a 200; ApiError otherwise."""
        if self.status != 200:
            raise ApiError(self.status, self.detail)
        return self.body


class CoordinatorClient:
    """The coordinator's API at ``url`` with ``token``."""

    def __init__(self, url: str, token: str | None, timeout: float = API_TIMEOUT_S) -> None:
        """A client of ``url`` (``http://host:port``), sending ``token`` as the bearer token."""
        self.url = url
        self.token = token
        self.timeout = timeout

    def call(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Reply:
        """One request; httpx.HTTPError when the coordinator cannot be reached."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        url = self.url.rstrip("/") + path
        with httpx.Client(timeout=timeout or self.timeout, trust_env=False) as client:
            response = client.request(method, url, json=body, headers=headers)
        try:
            return Reply(response.status_code, response.json())
        except ValueError:
            return Reply(response.status_code, {"detail": response.text})

    def expect(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """The body of a 200 to one request; ApiError otherwise (status 0: not reached)."""
        try:
            reply = self.call(method, path, body, timeout)
        except httpx.HTTPError as exc:
            raise ApiError(0, f"cannot reach the coordinator at {self.url}: {exc}") from exc
        return reply.expect()

    def devices(self) -> list[DeviceView]:
        """``GET /v1/devices``: every known device, paired or not, online or not."""
        return _DEVICES.validate_python(self.expect("GET", "/v1/devices"))

    def approve(self, name: str, code: str) -> Approved:
        """``POST /v1/pairing/approve``: pair ``name`` if ``code`` is its pairing code."""
        body = ApproveBody(name=name, code=code).model_dump()
        return Approved.model_validate(self.expect("POST", "/v1/pairing/approve", body))

    def revoke(self, name: str) -> Revoked:
        """``POST /v1/pairing/revoke``: ``name`` is refused everywhere from now on."""
        body = RevokeBody(name=name).model_dump()
        return Revoked.model_validate(self.expect("POST", "/v1/pairing/revoke", body))

    def deploy(
        self, body: Mapping[str, Any], timeout: float = API_DEPLOY_TIMEOUT_S
    ) -> VersionRecord:
        """``POST /v1/deployments`` with ``body`` (the route's ``DeployBody``): the version."""
        reply = self.expect("POST", "/v1/deployments", dict(body), timeout)
        return VersionRecord.model_validate(reply)

    def rollback(self, model_id: str) -> VersionRecord:
        """``POST /v1/deployments/{model_id}/rollback``: the version now serving."""
        return VersionRecord.model_validate(
            self.expect("POST", f"/v1/deployments/{model_id}/rollback")
        )
