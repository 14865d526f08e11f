"""Control-plane client: one HTTPS request per connection to an agent, peer name checked.

Blocking (``http.client`` over TLS 1.3); callers run it in worker threads. Every paired call
checks that the agent's certificate names the device the coordinator expects with the agent
role; pairing calls go to unpaired agents, whose self-signed certificates cannot be verified.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import TypeVar

from coordinator.config import Timeouts
from coordinator.errors import AgentError, AgentRefusedError
from coordinator.transport.bounded_http import (
    MAX_OFFER_BYTES,
    MAX_REPLY_BYTES,
    ExchangeError,
    exchange,
)
from coordinator.transport.tls import check_peer, pairing_context
from protocols.base import FrozenModel
from protocols.deploy import (
    ROLE_AGENT,
    AgentStatus,
    CertificateRenewal,
    DeployReport,
    ErrorReply,
    Hop,
    ProbeReport,
    ProbeRequest,
    Revocations,
    UnloadRequest,
)
from protocols.errors import SchemaError
from protocols.ledger import PRIVACY_PATH, PrivacyStatus, RunFateReport
from protocols.pairing import PairingGrant, PairingOffer
from protocols.training_copy import TrainingCopyOffer, TrainingCopyStatus

Model = TypeVar("Model", bound=FrozenModel)
PAIRING_TIMEOUT_S = 5.0
"""Total time for one exchange with an unpaired host (mDNS only suggested it)."""


@dataclass(frozen=True)
class AgentAddress:
    """Where an agent's control plane listens, and the device name its certificate must carry."""

    device: str
    host: str
    control_port: int


class AgentClient:
    """Talks to agents' control planes with the coordinator's client certificate."""

    def __init__(self, ctx: ssl.SSLContext, timeouts: Timeouts | None = None) -> None:
        """Calls with ``ctx``, each waiting as ``timeouts`` says (None: the defaults)."""
        self._ctx = ctx
        self._timeouts = timeouts or Timeouts()

    def status(self, agent: AgentAddress, timeout: float | None = None) -> AgentStatus:
        """``GET /v1/status`` (within ``timeout``; None: the configured agent call time)."""
        return self._call(agent, "GET", "/v1/status", b"", AgentStatus, timeout)

    def deploy(self, agent: AgentAddress, body: bytes) -> DeployReport:
        """``POST /v1/deploy`` with a body from :func:`protocols.deploy.encode_deploy_body`."""
        deploy_s = self._timeouts.agent_deploy_s
        return self._call(agent, "POST", "/v1/deploy", body, DeployReport, deploy_s)

    def unload(self, agent: AgentAddress, plan_version: int) -> AgentStatus:
        """``POST /v1/unload``."""
        body = UnloadRequest(plan_version=plan_version).model_dump_json().encode()
        return self._call(agent, "POST", "/v1/unload", body, AgentStatus)

    def probe(self, agent: AgentAddress, target: Hop, payload_bytes: int) -> ProbeReport:
        """``POST /v1/probe``: the agent measures its link to ``target``."""
        request = ProbeRequest(target=target, payload_bytes=payload_bytes, rounds=4)
        return self._call(
            agent, "POST", "/v1/probe", request.model_dump_json().encode(), ProbeReport
        )

    def metrics(self, agent: AgentAddress) -> str:
        """``GET /metrics``: the agent's Prometheus text exposition."""
        metrics_s = self._timeouts.agent_metrics_s
        status, data = _request(agent, "GET", "/metrics", b"", self._ctx, metrics_s, check=True)
        if status != 200:
            raise _refusal(agent, status, data)
        return data.decode("utf-8", errors="replace")

    def revocations(self, agent: AgentAddress, revoked: Revocations) -> AgentStatus:
        """``POST /v1/revocations``: install the complete revocation list."""
        body = revoked.model_dump_json().encode()
        return self._call(agent, "POST", "/v1/revocations", body, AgentStatus)

    def renew(self, agent: AgentAddress, renewal: CertificateRenewal) -> AgentStatus:
        """``POST /v1/certificate``: replace the agent's certificate before it expires."""
        body = renewal.model_dump_json().encode()
        return self._call(agent, "POST", "/v1/certificate", body, AgentStatus)

    def training_copy(self, agent: AgentAddress, offer: TrainingCopyOffer) -> TrainingCopyStatus:
        """``POST /v1/training/copy``: offer the signed version a run trains."""
        body = offer.model_dump_json().encode()
        return self._call(agent, "POST", "/v1/training/copy", body, TrainingCopyStatus)

    def training_file(self, agent: AgentAddress, data: bytes) -> TrainingCopyStatus:
        """``POST /v1/training/file``: one file the agent's pending copy lacks."""
        deploy_s = self._timeouts.agent_deploy_s
        return self._call(agent, "POST", "/v1/training/file", data, TrainingCopyStatus, deploy_s)

    def training_privacy(self, agent: AgentAddress) -> PrivacyStatus:
        """``GET /v1/training/privacy``: the totals of the agent's privacy ledger."""
        return self._call(agent, "GET", PRIVACY_PATH, b"", PrivacyStatus)

    def training_run_fate(self, agent: AgentAddress, report: RunFateReport) -> PrivacyStatus:
        """``POST /v1/training/privacy``: tell the agent's ledger what became of a run."""
        body = report.model_dump_json().encode()
        return self._call(agent, "POST", PRIVACY_PATH, body, PrivacyStatus)

    def _call(
        self,
        agent: AgentAddress,
        method: str,
        path: str,
        body: bytes,
        model: type[Model],
        timeout: float | None = None,
    ) -> Model:
        wait = self._timeouts.agent_call_s if timeout is None else timeout
        status, data = _request(agent, method, path, body, self._ctx, wait, check=True)
        return _parse(agent, status, data, model)


def fetch_offer(agent: AgentAddress) -> PairingOffer:
    """``GET /v1/pairing`` on an unpaired agent."""
    status, data = _request(
        agent, "GET", "/v1/pairing", b"", pairing_context(), PAIRING_TIMEOUT_S, False
    )
    return _parse(agent, status, data, PairingOffer)


def send_grant(agent: AgentAddress, grant: PairingGrant) -> AgentStatus:
    """``POST /v1/pairing`` to an unpaired agent: its certificate and the CA."""
    body = grant.model_dump_json().encode()
    status, data = _request(
        agent, "POST", "/v1/pairing", body, pairing_context(), PAIRING_TIMEOUT_S, False
    )
    return _parse(agent, status, data, AgentStatus)


def _request(
    agent: AgentAddress,
    method: str,
    path: str,
    body: bytes,
    ctx: ssl.SSLContext,
    timeout: float,
    check: bool,
) -> tuple[int, bytes]:
    """One exchange, ``timeout`` for all of it; replies over their cap are refused
    (:mod:`coordinator.transport.bounded_http`): an unpaired host gets :data:`MAX_OFFER_BYTES`."""
    limit = MAX_REPLY_BYTES if check else MAX_OFFER_BYTES
    verify = (lambda sock: check_peer(sock, agent.device, ROLE_AGENT)) if check else None
    try:
        return exchange(
            agent.host, agent.control_port, ctx, (method, path, body), timeout, limit, verify
        )
    except ExchangeError as exc:
        raise AgentError(f"{agent.device} ({agent.host}:{agent.control_port}): {exc}") from exc


def _parse(agent: AgentAddress, status: int, data: bytes, model: type[Model]) -> Model:
    if status != 200:
        raise _refusal(agent, status, data)
    try:
        return model.from_json(data)
    except SchemaError as exc:
        raise AgentError(f"{agent.device} sent an unreadable reply ({status}): {exc}") from exc


def _refusal(agent: AgentAddress, status: int, data: bytes) -> AgentError:
    """The error for a non-200 reply: its code and message, or that it could not be read."""
    try:
        reply = ErrorReply.from_json(data)
    except SchemaError as exc:
        return AgentError(f"{agent.device} sent an unreadable reply ({status}): {exc}")
    return AgentRefusedError(agent.device, status, reply.error, reply.message)
