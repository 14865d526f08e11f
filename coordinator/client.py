"""One typed client of the coordinator's own HTTP API (httpx), for the CLI, the demo, the labs
and benches.

Every call sends the bearer token (when there is one), ignores proxy settings from the
environment (``trust_env=False``: the coordinator is on loopback or the LAN) and takes its
timeout from the call or the client. Used as a context manager (``with CoordinatorClient(...)
as api:``) its calls share one keep-alive connection pool; otherwise each call opens its own.

- :meth:`CoordinatorClient.call` is one request: a :class:`Reply` with the status, the JSON
  body (a body that is no JSON comes back as ``{"detail": text}``) and the headers; a transport
  failure raises :class:`httpx.HTTPError`, so that a caller that retries can tell it from an
  answer.
- The typed methods return the API's own models (``DeviceView`` and the pairing replies of
  :mod:`coordinator.http.device_models`, the deployment store's records, the console's models,
  :mod:`protocols.training`'s run models, and :mod:`coordinator.http.replies` for the replies
  the routes build as plain JSON) and raise :class:`~coordinator.errors.ApiError` for
  anything but a 200, a transport failure included (status 0).
- :meth:`CoordinatorClient.stream` posts a streaming completion and yields its chunks as they
  arrive; a refusal before the stream is an ApiError, an error inside it a chunk with
  ``error``.

This module needs the coordinator extra (httpx, and the models' own imports): an entry point
that must stay light on an agent-only install imports it where it is used.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import TypeAdapter

from coordinator.config import API_DEPLOY_TIMEOUT_S, API_TIMEOUT_S
from coordinator.deploy.store import ModelRecord, VersionRecord
from coordinator.errors import ApiError
from coordinator.http.console import ConsoleModel, LiveSnapshot, WhatIfAnswer, WhatIfBody
from coordinator.http.device_models import (
    ApproveBody,
    Approved,
    DeviceView,
    RevokeBody,
    Revoked,
)
from coordinator.http.openai_serving import VERSION_HEADER
from coordinator.http.replies import CompletionChunk, EmbeddingsReply, FailoverView
from coordinator.http.serving import SpeculativeBody
from coordinator.trust.pairing import PairingBook
from protocols.links import Link as DeviceLink
from protocols.links import RequesterLink
from protocols.training import RunStatus, TrainingRunCreated, TrainingRunRequest

_DEVICES = TypeAdapter(list[DeviceView])
_MODELS = TypeAdapter(list[ModelRecord])
_CONSOLE = TypeAdapter(list[ConsoleModel])
_LINKS = TypeAdapter(list[DeviceLink])
_REQUESTER_LINKS = TypeAdapter(list[RequesterLink])
STREAM_DATA = "data: "
"""The prefix of a server-sent event's data line."""


@dataclass(frozen=True)
class Reply:
    """One answer of the API: its status, its JSON body and its headers (names lower case)."""

    status: int
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def detail(self) -> Any:
        """An error's message: the body's ``detail``, or an OpenAI-shaped ``error``'s
        ``message``; None when it has neither."""
        return _message(self.body)

    def expect(self) -> Any:
        """The body of a 200; ApiError otherwise."""
        if self.status != 200:
            raise ApiError(self.status, self.detail)
        return self.body


class CoordinatorClient:
    """The coordinator's API at ``url`` with ``token``."""

    def __init__(
        self,
        url: str,
        token: str | None,
        timeout: float = API_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """A client of ``url`` (``http://host:port``), sending ``token`` as the bearer token;
        ``transport`` carries the requests another way than a socket from this process (a
        lab's client in another network namespace)."""
        self.url = url
        self.token = token
        self.timeout = timeout
        self._transport = transport
        self._http: httpx.Client | None = None

    def __enter__(self) -> CoordinatorClient:
        """Keep one connection pool until the block ends (calls from several threads share it)."""
        self._http = self._open()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def _open(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(
            base_url=self.url.rstrip("/"),
            headers=headers,
            timeout=self.timeout,
            trust_env=False,
            transport=self._transport,
        )

    @contextlib.contextmanager
    def _session(self) -> Iterator[httpx.Client]:
        if self._http is not None:
            yield self._http
        else:
            with self._open() as http:
                yield http

    def call(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Reply:
        """One request; httpx.HTTPError when the coordinator cannot be reached."""
        with self._session() as http:
            response = http.request(method, path, json=body, timeout=timeout or self.timeout)
        headers = {k.lower(): v for k, v in response.headers.items()}
        try:
            return Reply(response.status_code, response.json(), headers)
        except ValueError:
            return Reply(response.status_code, {"detail": response.text}, headers)

    def _reply(
        self, method: str, path: str, body: Any = None, timeout: float | None = None
    ) -> Reply:
        """The reply to one request, a 200; ApiError otherwise (status 0: not reached)."""
        try:
            reply = self.call(method, path, body, timeout)
        except httpx.HTTPError as exc:
            raise ApiError(0, f"cannot reach the coordinator at {self.url}: {exc}") from exc
        reply.expect()
        return reply

    def expect(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """The body of a 200 to one request; ApiError otherwise (status 0: not reached)."""
        return self._reply(method, path, body, timeout).body

    # devices and pairing

    def devices(self) -> list[DeviceView]:
        """``GET /v1/devices``: every known device, paired or not, online or not."""
        return _DEVICES.validate_python(self.expect("GET", "/v1/devices"))

    def pairing(self) -> PairingBook:
        """``GET /v1/pairing``: the pairing book (pending, paired, revoked)."""
        return PairingBook.model_validate(self.expect("GET", "/v1/pairing"))

    def approve(self, name: str, code: str) -> Approved:
        """``POST /v1/pairing/approve``: pair ``name`` if ``code`` is its pairing code."""
        body = ApproveBody(name=name, code=code).model_dump()
        return Approved.model_validate(self.expect("POST", "/v1/pairing/approve", body))

    def revoke(self, name: str) -> Revoked:
        """``POST /v1/pairing/revoke``: ``name`` is refused everywhere from now on."""
        body = RevokeBody(name=name).model_dump()
        return Revoked.model_validate(self.expect("POST", "/v1/pairing/revoke", body))

    # deployments

    def deploy(
        self, body: Mapping[str, Any], timeout: float = API_DEPLOY_TIMEOUT_S
    ) -> VersionRecord:
        """``POST /v1/deployments`` with ``body`` (the route's ``DeployBody``): the version."""
        reply = self.expect("POST", "/v1/deployments", dict(body), timeout)
        return VersionRecord.model_validate(reply)

    def deployments(self) -> list[ModelRecord]:
        """``GET /v1/deployments``: every deployed model with its versions."""
        return _MODELS.validate_python(self.expect("GET", "/v1/deployments"))

    def deployment(self, model_id: str) -> ModelRecord:
        """``model_id``'s record in ``GET /v1/deployments``; ApiError 404 when it has none."""
        for record in self.deployments():
            if record.model_id == model_id:
                return record
        raise ApiError(404, f"the model {model_id!r} is not deployed")

    def active_version(self, model_id: str) -> VersionRecord:
        """The version that serves ``model_id`` now; ApiError 404 when none does."""
        record = self.deployment(model_id)
        version = record.version(record.active) if record.active is not None else None
        if version is None:
            raise ApiError(404, f"the model {model_id!r} has no active version")
        return version

    def set_speculative(
        self, model_id: str, speculative: str, draft_model: str | None = None
    ) -> ModelRecord:
        """``PUT /v1/deployments/{model_id}/speculative``: the model's record after it."""
        body = SpeculativeBody.model_validate(
            {"speculative": speculative, "draft_model": draft_model}
        ).model_dump(exclude_none=True)
        path = f"/v1/deployments/{model_id}/speculative"
        return ModelRecord.model_validate(self.expect("PUT", path, body))

    def rollback(self, model_id: str) -> VersionRecord:
        """``POST /v1/deployments/{model_id}/rollback``: the version now serving."""
        return VersionRecord.model_validate(
            self.expect("POST", f"/v1/deployments/{model_id}/rollback")
        )

    def failover(self) -> FailoverView:
        """``GET /v1/failover``: the models failover is handling, and its events."""
        return FailoverView.model_validate(self.expect("GET", "/v1/failover"))

    # console

    def console_models(self) -> list[ConsoleModel]:
        """``GET /v1/console/models``: the deployed models as the console lists them."""
        return _CONSOLE.validate_python(self.expect("GET", "/v1/console/models"))

    def live_metrics(self, model_id: str | None = None) -> LiveSnapshot:
        """``GET /v1/metrics``: requests and stage rates now (of ``model_id``, or of all)."""
        path = "/v1/metrics" + (f"?model={model_id}" if model_id is not None else "")
        return LiveSnapshot.model_validate(self.expect("GET", path))

    def what_if(self, body: WhatIfBody) -> WhatIfAnswer:
        """``POST /v1/plan/what-if``: the plan now and the plan ``body`` would give."""
        reply = self.expect("POST", "/v1/plan/what-if", body.model_dump(mode="json"))
        return WhatIfAnswer.model_validate(reply)

    # links

    def links(self) -> list[DeviceLink]:
        """``GET /v1/links``: the measured links between agents."""
        return _LINKS.validate_python(self.expect("GET", "/v1/links"))

    def requester_links(self) -> list[RequesterLink]:
        """``GET /v1/links/requester``: the measured links from the coordinator to each agent."""
        return _REQUESTER_LINKS.validate_python(self.expect("GET", "/v1/links/requester"))

    def measure_links(self, timeout: float | None = None) -> list[DeviceLink]:
        """``POST /v1/links/measure``: measure every link between agents now."""
        return _LINKS.validate_python(self.expect("POST", "/v1/links/measure", None, timeout))

    # serving

    def embeddings(
        self, model: str, texts: str | list[str], timeout: float | None = None
    ) -> EmbeddingsReply:
        """``POST /v1/embeddings``: the vectors and the plan version that computed them."""
        reply = self._reply("POST", "/v1/embeddings", {"model": model, "input": texts}, timeout)
        version = reply.headers.get(VERSION_HEADER.lower())
        plan_version = int(version) if version is not None else None
        return EmbeddingsReply.model_validate({**reply.body, "plan_version": plan_version})

    def stream(
        self, path: str, body: Mapping[str, Any], timeout: float | None = None
    ) -> Iterator[CompletionChunk]:
        """``POST path`` (``/v1/completions`` or ``/v1/chat/completions``) with ``stream``
        on: each chunk as it arrives; ApiError when the request is refused (status 0: not
        reached)."""
        ask = {**body, "stream": True}
        try:
            with (
                self._session() as http,
                http.stream("POST", path, json=ask, timeout=timeout or self.timeout) as reply,
            ):
                if reply.status_code != 200:
                    reply.read()
                    raise ApiError(reply.status_code, _detail(reply))
                for line in reply.iter_lines():
                    if line.startswith(STREAM_DATA + "{"):
                        yield CompletionChunk.model_validate(json.loads(line[len(STREAM_DATA) :]))
        except httpx.HTTPError as exc:
            raise ApiError(0, f"cannot reach the coordinator at {self.url}: {exc}") from exc

    # training

    def start_training(self, request: TrainingRunRequest) -> TrainingRunCreated:
        """``POST /v1/training/runs``: the new run's id (409 while another run is going)."""
        body = request.model_dump(mode="json", exclude_unset=True)
        return TrainingRunCreated.model_validate(self.expect("POST", "/v1/training/runs", body))

    def training_run(self, run_id: str) -> RunStatus:
        """``GET /v1/training/runs/{run_id}``: the run's state and its rounds so far."""
        return RunStatus.model_validate(self.expect("GET", f"/v1/training/runs/{run_id}"))


def _message(body: Any) -> Any:
    """The error message in a JSON reply body: ``detail``, or ``error.message``, or None."""
    if not isinstance(body, dict):
        return None
    if "detail" in body:
        return body["detail"]
    error = body.get("error")
    return error.get("message", error) if isinstance(error, dict) else error


def _detail(response: httpx.Response) -> Any:
    """A refused stream's message, or its text."""
    try:
        body = response.json()
    except ValueError:
        return response.text
    return _message(body) or body
