"""Request routing: named tensors in, the active version's chain, named outputs back.

:class:`Router` checks a request against the model's declared inputs (names, element types,
ranks, fixed dimensions) before anything reaches an agent, then sends it to the first agent of
the model's *active* version, unless one of its devices was revoked: the coordinator refuses
a revoked device too. It reads the active version per request, so a switch (deploy or
rollback) takes effect between requests while requests already sent finish on the version they
started on, which stays loaded.

A request whose chain fails is reported to the :class:`Guard` (the failover policy,
:mod:`coordinator.serving.failover`), which
checks the chain's devices and re-plans when one is lost;
the request is then retried on the version the guard hands out, waiting for a re-plan at most
:attr:`~coordinator.config.Timeouts.recovery_s` in all. Without failover, a broken connection
is retried on a fresh one.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import numpy as np

from coordinator.config import Timeouts
from coordinator.deploy.store import DeploymentStore, VersionRecord, version_label
from coordinator.errors import AgentError, CoordinatorError, NotServableError, RequestError
from coordinator.serving.microbatch import join_runs, row_runs
from coordinator.transport.dataplane import ChainClient, DataPlane
from protocols.deploy import Hop
from protocols.frames import DTYPES
from protocols.manifest import TensorInfo

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3
SAME_VERSION_TRIES = 3
"""Sends of one request: the first, and retries after chain failures."""

Arrays = dict[str, np.ndarray[Any, Any]]


class Guard(Protocol):
    """Which version a request may use, and what to do when its chain fails."""

    def current(self, model_id: str, deadline: float) -> VersionRecord:
        """The version to send to now; may wait (until ``deadline``, monotonic) for a re-plan.

        Raises NotServableError (UnavailableError when the devices left cannot hold it).
        """
        ...

    def failed(self, version: VersionRecord, error: CoordinatorError) -> None:
        """A request on ``version``'s chain failed with ``error``."""
        ...

    def usable(self, plan_version: int) -> bool:
        """Whether requests may still be sent to this plan version's chain."""
        ...


class NoFailover:
    """The :class:`Guard` without failover: always the active version, failures just retried."""

    def __init__(self, store: DeploymentStore) -> None:
        self._store = store

    def current(self, model_id: str, deadline: float) -> VersionRecord:
        """The active version."""
        return self._store.active(model_id)

    def failed(self, version: VersionRecord, error: CoordinatorError) -> None:
        """Nothing to do: the router retries on a fresh connection."""

    def usable(self, plan_version: int) -> bool:
        """Every version is."""
        return True


class Router:
    """Sends requests to the active version of a model over the data plane."""

    def __init__(
        self,
        store: DeploymentStore,
        plane: DataPlane,
        ctx: ssl.SSLContext,
        revoked: Callable[[], Collection[str]] = frozenset,
        guard: Guard | None = None,
        timeouts: Timeouts | None = None,
    ) -> None:
        self._store = store
        self._timeouts = timeouts or Timeouts()
        self._plane = plane
        self._ctx = ctx
        self._revoked = revoked
        self._guard = guard or NoFailover(store)
        self._clients: dict[int, ChainClient] = {}
        self._lock = threading.Lock()

    def infer(self, model_id: str, tensors: Mapping[str, Any]) -> tuple[VersionRecord, Arrays]:
        """Run one request on the live version; the version that answered and its outputs."""
        version = self._store.active(model_id)
        refused = sorted({p.device for p in version.segments} & set(self._revoked()))
        if refused:
            self._forget(version.plan_version)
            raise NotServableError(
                f"model {version_label(version)} runs on revoked devices {refused}; deploy it again"
            )
        feeds = check_inputs(version.inputs, tensors)
        runs = row_runs(version.limits, version.inputs, feeds)
        if len(runs) == 1:
            return self.serve(model_id, feeds)
        return self._serve_runs(model_id, feeds, runs, version.outputs)

    def _serve_runs(
        self, model_id: str, feeds: Arrays, runs: list[slice], outputs: list[TensorInfo]
    ) -> tuple[VersionRecord, Arrays]:
        """A request larger than the planned shapes, as consecutive runs that fit, all
        answered by one plan version (else sent again, like embeddings' micro-batches)."""
        if any(not o.shape or o.shape[0] != "batch" for o in outputs):
            join_runs([{}, {}], outputs)  # raises ShapeLimitError: nothing to join along
        for _ in range(SAME_VERSION_TRIES):
            answers = [self.serve(model_id, {n: a[run] for n, a in feeds.items()}) for run in runs]
            if len({version.plan_version for version, _ in answers}) == 1:
                return answers[0][0], join_runs([out for _, out in answers], outputs)
        raise NotServableError(f"model {model_id!r} changed version during every try")

    def serve(self, model_id: str, feeds: Arrays) -> tuple[VersionRecord, Arrays]:
        """Send checked inputs to the live version; after a chain failure, report it to the
        guard and retry on the version it hands out (every caller gets one answer or one error).
        """
        deadline = time.monotonic() + self._timeouts.recovery_s
        version = self._guard.current(model_id, deadline)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return version, self._attempt(version, feeds)
            except (AgentError, NotServableError) as exc:
                log.info("%s failed (attempt %d): %s", version_label(version), attempt, exc)
                if attempt == MAX_ATTEMPTS:
                    raise NotServableError(f"model {model_id!r} cannot be served: {exc}") from exc
                self._guard.failed(version, exc)
                version = self._guard.current(model_id, deadline)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _attempt(self, version: VersionRecord, feeds: Arrays) -> Arrays:
        client = self._client(version)
        try:
            return client.infer(feeds, self._timeouts.request_s)
        except AgentError:
            self._drop(version.plan_version, client)
            raise

    def chain_client(self, model_id: str, deadline: float) -> tuple[VersionRecord, ChainClient]:
        """The version to use now and its chain client, for callers that drive the chain
        themselves (generation steps); may wait until ``deadline`` for a re-plan."""
        version = self._guard.current(model_id, deadline)
        return version, self._client(version)

    def chain_failed(self, version: VersionRecord, error: CoordinatorError) -> None:
        """Report a failure on ``version``'s chain seen by such a caller."""
        self._guard.failed(version, error)

    def health(self, chain: list[Hop], plan_version: int, feeds: Arrays) -> Arrays:
        """A request into a chain that is not active yet (the deployer's health check)."""
        client = ChainClient(self._plane, chain, plan_version, self._ctx)
        try:
            return client.infer(feeds, self._timeouts.request_s)
        finally:
            client.close()

    def abort(self, plan_version: int, reason: str) -> None:
        """Fail the requests in flight on a version's chain (a device of it was lost).

        The guard marks the version unusable first; :meth:`_client` checks that under the same
        lock this takes, so no request can slip onto the chain after it is aborted.
        """
        with self._lock:
            client = self._clients.pop(plan_version, None)
        if client is not None:
            client.abort(reason)

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def _client(self, version: VersionRecord) -> ChainClient:
        with self._lock:
            if not self._guard.usable(version.plan_version):
                raise AgentError(f"plan version {version.plan_version} lost a device")
            client = self._clients.get(version.plan_version)
            if client is None:
                chain = [
                    Hop(device=p.device, host=p.host, data_port=p.data_port)
                    for p in version.segments
                ]
                client = ChainClient(self._plane, chain, version.plan_version, self._ctx)
                self._clients[version.plan_version] = client
            return client

    def retire(self, plan_version: int) -> None:
        """Close the connections of a version that was unloaded."""
        self._forget(plan_version)

    def _forget(self, plan_version: int) -> None:
        with self._lock:
            client = self._clients.pop(plan_version, None)
        if client is not None:
            client.close()

    def _drop(self, plan_version: int, client: ChainClient) -> None:
        with self._lock:
            if self._clients.get(plan_version) is client:
                del self._clients[plan_version]
        client.close()


def check_inputs(declared: list[TensorInfo], given: Mapping[str, Any]) -> Arrays:
    """Arrays for exactly the declared inputs, in their declared types; raises RequestError."""
    names = {t.name for t in declared}
    missing, extra = sorted(names - set(given)), sorted(set(given) - names)
    if missing or extra:
        raise RequestError(
            f"inputs must be exactly {sorted(names)}; missing {missing}, extra {extra}"
        )
    feeds: Arrays = {}
    for info in declared:
        feeds[info.name] = _as_array(info, given[info.name])
    return feeds


def _as_array(info: TensorInfo, value: Any) -> np.ndarray[Any, Any]:
    dtype = np.dtype(info.dtype)
    if dtype not in DTYPES.values():
        raise RequestError(f"input {info.name!r} has type {info.dtype}, which frames cannot carry")
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise RequestError(f"input {info.name!r} is not a rectangular array: {exc}") from exc
    if array.dtype == object or array.dtype.kind not in "biuf":
        raise RequestError(f"input {info.name!r} must hold numbers, not {array.dtype}")
    if array.dtype.kind == "f" and dtype.kind in "iu":
        raise RequestError(f"input {info.name!r} must hold integers ({info.dtype})")
    if array.ndim != len(info.shape):
        raise RequestError(
            f"input {info.name!r} has rank {array.ndim}; the model takes shape {info.shape}"
        )
    for axis, (got, want) in enumerate(zip(array.shape, info.shape, strict=True)):
        if isinstance(want, int) and want > 0 and got != want:
            raise RequestError(
                f"input {info.name!r} has {got} along axis {axis}; the model needs {want}"
            )
        if got == 0:
            raise RequestError(f"input {info.name!r} is empty along axis {axis}")
    return np.ascontiguousarray(array.astype(dtype, copy=False))
