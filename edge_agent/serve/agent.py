"""The agent process: identity, profile, control and data planes, advertising, shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

from edge_agent.config import AgentConfig, TlsFiles
from edge_agent.errors import ConfigError, PeerRejectedError
from edge_agent.net.budgets import (
    ConnectionLimits,
    control_body_budget,
    frame_allowance,
    frame_allowance_per_peer,
)
from edge_agent.net.channel import FrameServer
from edge_agent.net.control import (
    COORDINATOR_ONLY,
    ControlServer,
    Response,
    Route,
    json_response,
)
from edge_agent.net.discovery import Advertiser
from edge_agent.net.frame_budget import UnfinishedBudget
from edge_agent.net.links import PeerLink
from edge_agent.net.probe import probe_link
from edge_agent.net.tls import (
    Peer,
    Revocation,
    client_context,
    control_context,
    peer_of,
    server_context,
)
from edge_agent.profile.microbench import ComputeProfile
from edge_agent.runtime.engine import release_freed_heap, resident_bytes
from edge_agent.runtime.fixed_costs import RecentCosts
from edge_agent.runtime.segments import SegmentStore
from edge_agent.serve.metrics import AgentMetrics
from edge_agent.serve.pipeline import Pipeline
from edge_agent.training.copies import TrainingCopies, privacy_policy, training_routes
from edge_agent.trust.identity import Identity, load_identity
from edge_agent.trust.pairing import (
    accept_grant,
    grant_key,
    pairing_offer,
    pairing_server_context,
    shown_code,
)
from edge_agent.trust.renewal import accept_renewal
from hostkit.files import write_atomic
from protocols.deploy import (
    AgentStatus,
    CertificateRenewal,
    ErrorReply,
    Hop,
    LoadedSegment,
    ProbeRequest,
    Revocations,
    UnloadRequest,
    decode_deploy_body,
)
from protocols.errors import ControlErrorCode, SchemaError
from protocols.pairing import PairingGrant, PairingOffer
from protocols.profile import AgentState, Announcement, DeviceProfile

log = logging.getLogger(__name__)

REVOCATIONS_FILE = "revocations.json"
READY_FILE = "agent.json"
TRIM_AFTER = 64
"""Control connections served before the heap is trimmed, once none is open."""
"""Written to the state dir once the agent listens: name, device id, ports, pid."""

_Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, Peer], Awaitable[None]]


class Agent:
    """One running agent. Build it with its config and identity, then ``await run(stop)``."""

    def __init__(
        self,
        config: AgentConfig,
        identity: Identity,
        profile: ComputeProfile,
        advertiser: Advertiser | None,
    ) -> None:
        self.config = config
        self.identity = identity
        self.profile = profile
        self._costs = RecentCosts()
        self._advertiser = advertiser
        self.metrics = AgentMetrics()
        self.store = SegmentStore(
            identity, config.memory_bytes, config.runtime, config.state_dir / "segments"
        )
        self._server_ctx = server_context(identity)
        self._control_ctx = control_context(identity, config.metrics_token is not None)
        self._client_ctx = client_context(identity)
        self._pairing_ctx = pairing_server_context(identity)
        self.pipeline = Pipeline(self.store, self.metrics, self._link, config.queue_depth)
        self._control = ControlServer(
            {
                ("POST", "/v1/deploy"): Route(
                    self._deploy, COORDINATOR_ONLY, config.max_deploy_bytes
                ),
                ("POST", "/v1/unload"): Route(self._unload, COORDINATOR_ONLY),
                ("POST", "/v1/probe"): Route(self._probe, COORDINATOR_ONLY),
                ("POST", "/v1/revocations"): Route(self._revoke, COORDINATOR_ONLY),
                ("POST", "/v1/certificate"): Route(self._renew, COORDINATOR_ONLY),
                ("GET", "/v1/status"): Route(
                    self._status, COORDINATOR_ONLY, token=config.metrics_token
                ),
                ("GET", "/v1/pairing"): Route(self._pairing_offer, None),
                ("POST", "/v1/pairing"): Route(self._pair, None),
                ("GET", "/metrics"): Route(
                    self._metrics, COORDINATOR_ONLY, token=config.metrics_token
                ),
                **self._training_routes(),
            },
            config.max_deploy_bytes,
            body_budget=UnfinishedBudget(control_body_budget(config.memory_bytes)),
        )
        self._control_limits = ConnectionLimits.for_memory(config.memory_bytes)
        self._served_since_trim = 0
        self._connections: set[asyncio.Task[object]] = set()
        self.revocation = _load_revocation(config.state_dir / REVOCATIONS_FILE)
        self._data: FrameServer | None = None
        self._ports = (0, 0)
        self._grant_key = b"" if identity.paired else grant_key(identity)
        self._offer: PairingOffer | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set, then withdraw the announcement and close everything."""
        cfg = self.config
        ready = cfg.state_dir / READY_FILE
        control: asyncio.Server | None = None
        self.pipeline.start()
        try:
            control = await asyncio.start_server(
                lambda r, w: self._accept(r, w, self._serve_control),
                cfg.interface,
                cfg.control_port,
                limit=1 << 16,
            )
            allowance = frame_allowance(cfg.memory_bytes, cfg.max_frame_bytes)
            self._data = FrameServer(
                self.pipeline.serve,
                self._server_ctx,
                cfg.max_frame_bytes,
                self.revocation.admit,
                max_unfinished_bytes=allowance,
                limits=ConnectionLimits.for_memory(cfg.memory_bytes),
                max_unfinished_per_peer=frame_allowance_per_peer(allowance),
            )
            data_port = await self._data.start(cfg.interface, cfg.data_port)
            self._ports = (control.sockets[0].getsockname()[1], data_port)
            if self._advertiser is not None:
                await self._advertiser.start(self.announcement())
            _write_ready(ready, self)
            log.info(
                "agent %s ready: control %s:%d, data %s:%d, %s, %.1f GFLOP/s, %s GB/s",
                cfg.name,
                cfg.interface,
                self._ports[0],
                cfg.interface,
                self._ports[1],
                "paired"
                if self.identity.paired
                else f"UNPAIRED, pairing code {shown_code(self.identity)}",
                self.profile.gflops,
                self.profile.memory_gbps,
            )
            await stop.wait()
            log.info("agent %s stopping", cfg.name)
        finally:
            ready.unlink(missing_ok=True)
            if self._advertiser is not None:
                await self._advertiser.close()
            if control is not None:
                control.close()
                for task in list(self._connections):
                    task.cancel()
                await asyncio.gather(*self._connections, return_exceptions=True)
                await control.wait_closed()
            if self._data is not None:
                await self._data.close()
            await self.pipeline.stop()

    @property
    def ports(self) -> tuple[int, int]:
        """(control, data) ports once listening."""
        return self._ports

    def announcement(self) -> Announcement:
        """The current TXT content: profile plus the newest loaded segment."""
        latest = self.store.all()[-1] if self.store.all() else None
        profile = DeviceProfile(
            device_id=self.identity.device_id,
            name=self.config.name,
            memory_bytes=self.config.memory_bytes,
            **self.profile.roofs(),
            int4_rows_exact=self.profile.int4_rows_exact,
            control_port=self._ports[0],
            data_port=self._ports[1],
            cert_fingerprint=self.identity.cert_fingerprint,
        )
        state = AgentState(
            paired=self.identity.paired,
            segment_sha256=latest.manifest.segment.sha256 if latest else None,
            plan_version=latest.manifest.plan_version if latest else 0,
        )
        return Announcement(profile=profile, state=state)

    async def _accept(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: _Handler,
    ) -> None:
        """Control-plane connection: TLS handshake (logged when refused), then one request."""
        plane = "control"
        task = asyncio.current_task()
        assert task is not None
        address = writer.get_extra_info("peername")
        source = self._control_limits.admit(address)
        if source is None:  # over the caps: closed before the TLS handshake costs anything
            writer.transport.abort()
            return
        self._connections.add(task)
        try:
            try:
                paired = self.identity.paired
                ctx = self._control_ctx if paired else self._pairing_ctx
                await writer.start_tls(ctx, ssl_handshake_timeout=10.0)
                ssl_object = writer.get_extra_info("ssl_object")
                certified = ssl_object is not None and bool(ssl_object.getpeercert())
                # a paired agent's control context asks for a certificate; only with a metrics
                # token is it optional, and a caller without one has no role
                if certified or (paired and self.config.metrics_token is None):
                    peer = self.revocation.admit(peer_of(ssl_object))
                else:
                    peer = Peer(name=f"unauthenticated {address}", role="")
            except (ssl.SSLError, OSError, TimeoutError, PeerRejectedError) as exc:
                self.metrics.frame_errors.labels("TlsHandshake").inc()
                log.warning("refused %s-plane connection from %s: %s", plane, address, exc)
                writer.transport.abort()
                return
            try:
                await handler(reader, writer, peer)
            except (OSError, ssl.SSLError) as exc:
                log.info("%s-plane connection from %s ended: %s", plane, peer.name, exc)
            finally:
                writer.close()
        except asyncio.CancelledError:
            # Only our own shutdown cancels these. Python 3.11's start_server callback calls
            # task.exception() on a cancelled task and logs a spurious traceback, so end normally.
            log.debug("%s-plane connection from %s closed at shutdown", plane, address)
        finally:
            self._connections.discard(task)
            self._control_limits.release(source)
            self._trim_after_burst()

    def _trim_after_burst(self) -> None:
        """Once a burst of control connections is over (none open), hand the heap their bodies
        and TLS buffers used back to the OS: glibc keeps freed memory otherwise (a flood of
        pairing bodies left +88 MiB resident a minute later)."""
        self._served_since_trim += 1
        if self._control_limits.open() == 0 and self._served_since_trim >= TRIM_AFTER:
            self._served_since_trim = 0
            release_freed_heap()

    def _training_routes(self) -> dict[tuple[str, str], Route]:
        """``/v1/training/copy`` and ``/file`` when the agent trains (no torch imported)."""
        if self.config.training is None:
            return {}
        train = self.config.training
        root = self.config.state_dir / "training"
        copies = TrainingCopies(root, train.storage_bytes, lambda: self.identity.ca_public_key)
        return training_routes(copies, privacy_policy(root, train))

    async def _serve_control(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Peer
    ) -> None:
        await self._control.handle(reader, writer, peer)

    def _link(self, hop: Hop) -> PeerLink:
        return PeerLink(
            hop, self._client_ctx, self.config.max_frame_bytes, admit=self.revocation.admit
        )

    async def _deploy(self, body: bytes) -> Response:
        request, segment, warmup = decode_deploy_body(body)
        deployed = await asyncio.to_thread(self.store.deploy, request, segment, warmup)
        report = deployed.report
        self.metrics.segment_memory.labels(str(report.plan_version)).set(
            report.measured_memory_bytes
        )
        if report.costs is not None:  # the status and the TXT record say the recent median
            typical = self._costs.add(report.costs)
            self.profile = self.profile.model_copy(update=typical.model_dump())
        await self._announce()
        return json_response(report.model_dump_json())

    async def _unload(self, body: bytes) -> Response:
        request = UnloadRequest.from_json(body)
        if self.store.unload(request.plan_version):
            self.metrics.segment_memory.remove(str(request.plan_version))
            await self._announce()
        return await self._status(b"")

    async def _probe(self, body: bytes) -> Response:
        request = ProbeRequest.from_json(body)
        report = await probe_link(
            self.config.name, request, self._client_ctx, self.config.max_frame_bytes
        )
        return json_response(report.model_dump_json())

    async def _revoke(self, body: bytes) -> Response:
        request = Revocations.from_json(body)
        path = self.config.state_dir / REVOCATIONS_FILE
        write_atomic(path, request.model_dump_json().encode())
        self.revocation.replace(request.names, request.fingerprints)
        dropped = self._data.drop(self.revocation.revoked) if self._data is not None else 0
        await self.pipeline.drop_links(self.revocation.names)
        log.warning(
            "revocation list now has %d names, %d fingerprints; dropped %d connections",
            len(request.names),
            len(request.fingerprints),
            dropped,
        )
        return await self._status(b"")

    async def _pairing_offer(self, body: bytes) -> Response:
        if self.identity.paired:
            reply = ErrorReply(
                error=ControlErrorCode.ALREADY_PAIRED, message="this agent is already paired"
            )
            return Response(410, reply.model_dump_json().encode())
        if self._offer is None:
            self._offer = pairing_offer(self.identity, self._grant_key)
        return json_response(self._offer.model_dump_json())

    async def _pair(self, body: bytes) -> Response:
        grant = PairingGrant.from_json(body)
        files = accept_grant(self.identity, grant, self.config.state_dir, self._grant_key)
        self._use(load_identity(dataclasses.replace(self.config, tls=files)))
        log.warning(
            "paired: certificate %s from the coordinator's CA", self.identity.cert_fingerprint
        )
        await self._announce()
        return await self._status(b"")

    async def _renew(self, body: bytes) -> Response:
        accept_renewal(self.identity, CertificateRenewal.from_json(body))
        files = TlsFiles(self.identity.ca_path, self.identity.cert_path, self.identity.key_path)
        self._use(load_identity(dataclasses.replace(self.config, tls=files)))
        log.warning("certificate renewed: %s", self.identity.cert_fingerprint)
        await self._announce()
        return await self._status(b"")

    def _use(self, identity: Identity) -> None:
        """Serve every new connection with ``identity``'s certificate."""
        self.identity = identity
        self._server_ctx = server_context(identity)
        self._control_ctx = control_context(identity, self.config.metrics_token is not None)
        self._client_ctx = client_context(identity)
        self.store.identity = identity
        if self._data is not None:
            self._data.ctx = self._server_ctx

    async def _status(self, body: bytes) -> Response:
        status = AgentStatus(
            name=self.config.name,
            device_id=self.identity.device_id,
            memory_budget_bytes=self.config.memory_bytes,
            memory_committed_bytes=self.store.committed_bytes(),
            resident_memory_bytes=resident_bytes(),
            **self.profile.roofs(),
            paired=self.identity.paired,
            segments=[
                LoadedSegment(
                    report=d.report,
                    deployment=d.manifest.deployment,
                    segment_index=d.manifest.segment.index,
                    chain_length=len(d.manifest.chain),
                )
                for d in self.store.all()
            ],
        )
        return json_response(status.model_dump_json())

    async def _metrics(self, body: bytes) -> Response:
        return Response(200, self.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")

    async def _announce(self) -> None:
        if self._advertiser is not None:
            await self._advertiser.update(self.announcement())


def _load_revocation(path: Path) -> Revocation:
    if not path.exists():
        return Revocation()
    try:
        saved = Revocations.from_json(path.read_bytes())
    except (OSError, SchemaError) as exc:
        raise ConfigError(f"cannot read the revocation list {path}: {exc}") from exc
    return Revocation(saved.names, saved.fingerprints)


def _write_ready(path: Path, agent: Agent) -> None:
    info = {
        "name": agent.config.name,
        "device_id": agent.identity.device_id,
        "interface": agent.config.interface,
        "control_port": agent.ports[0],
        "data_port": agent.ports[1],
        "pid": os.getpid(),
    }
    write_atomic(path, json.dumps(info).encode())
