"""Pairing and revocation as the running coordinator does them, over the agents' control planes.

:class:`TrustService` polls the registry: for every online agent that announces itself unpaired
(and is not revoked) it fetches the agent's :class:`~protocols.pairing.PairingOffer` and records
it as pending, with its code. Approving ``NAME CODE`` issues the certificate and POSTs the
:class:`~protocols.pairing.PairingGrant` to the agent (retried by the poller if the agent was
unreachable). Revoking pushes the complete revocation list to every paired agent, and to any
paired agent seen later, so every agent refuses the device on both planes.

Every exchange (an offer fetched, a grant delivered, a revocation list or a renewed certificate
pushed) runs on its own task under its own deadline (:mod:`coordinator.trust.exchanges`), and
its result is handled as it completes: a poll round only starts what is due, so a host that
drips or fails delays nobody else's pairing, and it backs off per endpoint.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

from coordinator.config import Retries, Timeouts
from coordinator.errors import AgentError, PairingError
from coordinator.fleet.registry import DeviceRecord, DeviceRegistry
from coordinator.transport.agent_client import AgentAddress, AgentClient, fetch_offer, send_grant
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.exchanges import Endpoint, Exchanges
from coordinator.trust.offers import OfferTableFullError
from coordinator.trust.pairing import PairedDevice, Pairing
from coordinator.trust.renewal import expires_soon, needs_push
from protocols.deploy import AgentStatus, CertificateRenewal, Revocations
from protocols.pairing import PairingGrant, PairingOffer, grant_proof

log = logging.getLogger(__name__)


def address_of(record: DeviceRecord) -> AgentAddress:
    """Where a registry record's control plane listens."""
    return AgentAddress(record.name, record.host, record.announcement.profile.control_port)


class TrustService:
    """Pending offers from discovered agents, grants, and revocation pushes."""

    def __init__(
        self,
        pairing: Pairing,
        registry: DeviceRegistry,
        ca: CertificateAuthority,
        agents: AgentClient,
        timeouts: Timeouts | None = None,
        retries: Retries | None = None,
    ) -> None:
        self._pairing = pairing
        self._registry = registry
        self._ca = ca
        self._agents = agents
        self._wait_s = (timeouts or Timeouts()).trust_delivery_s
        self._retries = retries or Retries()
        self._exchanges = Exchanges(retries=self._retries)
        self._offered: set[str] = set()
        """Fingerprints of unpaired agents whose offer is recorded."""
        self._undelivered: dict[str, PairedDevice] = {}
        self._grant_keys: dict[str, bytes] = {}
        """The key each undelivered grant proves knowledge of the code with."""
        self._retry_at: dict[str, float] = {}
        """Fingerprint -> when a renewed certificate is sent again."""
        self._revocations_sent: dict[str, Revocations] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def trusted(self) -> list[DeviceRecord]:
        """Online devices paired with exactly the certificate they announce, not revoked."""
        return [
            r
            for r in self._registry.devices()
            if r.announcement.state.paired and self._pairing.is_trusted(r.name, r.fingerprint)
        ]

    def approve(self, name: str, code: str) -> PairedDevice:
        """Issue ``name``'s certificate if ``code`` matches, and deliver it to the agent
        (waiting up to :attr:`~coordinator.config.Timeouts.trust_delivery_s` for the
        deliveries; the poller retries the rest)."""
        device, key = self._pairing.approve_with_key(name, code)
        with self._lock:
            self._undelivered[name] = device
            self._grant_keys[name] = key
        self._exchanges.wait_idle(self._wait_s, self._deliver_grants())
        return device

    def revoke(self, name: str) -> list[str]:
        """Revoke ``name`` and tell every paired agent, all at once; returns the agents that
        were told within :attr:`~coordinator.config.Timeouts.trust_delivery_s` (the poller
        tells the others later)."""
        self._pairing.revoke(name)
        told: list[str] = []
        started = self._push_revocations(force=True, told=told)
        self._exchanges.wait_idle(self._wait_s, started)
        with self._lock:
            return sorted(told)

    def poll_once(self) -> None:
        """One round, waited for (up to
        :attr:`~coordinator.config.Timeouts.trust_delivery_s`): see :meth:`start_round`."""
        self.start_round()
        self._exchanges.wait_idle(self._wait_s)

    def start_round(self) -> None:
        """Start what is due: offer fetches, grant deliveries, revocation and renewal pushes.

        Each runs on its own task and is handled as it completes; nothing here waits for one.
        """
        self._collect_offers()
        self._deliver_grants()
        self._push_revocations(force=False)
        self._renew_certificates()

    def in_flight(self) -> int:
        """Exchanges with agents running now."""
        return self._exchanges.in_flight()

    def start(self) -> None:
        """Poll in a background thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="pairing-poller")
        self._thread.start()

    def stop(self) -> None:
        """Stop polling, join the thread, and end every exchange (cancelled or finished)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30.0)
        self._exchanges.close()

    def _run(self) -> None:
        while not self._stop.wait(self._retries.trust_poll_s):
            try:
                self.start_round()
            except Exception:  # the poller must outlive any one bad round
                log.exception("pairing round failed")

    def _collect_offers(self) -> None:
        """Start fetching the offers of newly seen unpaired agents, each on its own."""
        self._prune_offers()
        book = self._pairing.book()
        paired = {d.name for d in book.paired}
        with self._lock:
            offered = set(self._offered)
        for record in self._registry.devices():
            if (
                record.announcement.state.paired
                or record.fingerprint in offered
                or record.name in book.revoked_names
                or record.name in paired
            ):
                continue
            address = address_of(record)
            self._exchanges.start(
                _endpoint(record), partial(fetch_offer, address), partial(self._fetched, record)
            )

    def _fetched(self, record: DeviceRecord, offer: PairingOffer | AgentError) -> None:
        if isinstance(offer, AgentError):
            log.info("no pairing offer from %s yet: %s", record.name, offer)
        else:
            self._record_offer(record, offer)

    def _record_offer(self, record: DeviceRecord, offer: PairingOffer) -> None:
        if offer.name != record.name:
            log.warning("%s offered a request for %r; ignored", record.name, offer.name)
            return
        try:
            key_id = self._pairing.request(
                offer.name, offer.csr_pem, offer.node_public_key, offer.commitment
            )
        except OfferTableFullError as exc:
            log.warning("pairing offer from %s not recorded: %s", record.name, exc)
            return
        except PairingError as exc:
            with self._lock:
                self._offered.add(record.fingerprint)  # refused once, not fetched again
            log.warning("pairing offer from %s refused: %s", record.name, exc)
            return
        with self._lock:
            self._offered.add(record.fingerprint)
        log.warning("pairing request from %s (key %s)", record.name, key_id)

    def _renew_certificates(self) -> None:
        """Renew expiring certificates and send renewed ones (:mod:`coordinator.trust.renewal`)."""
        now = time.monotonic()
        devices = {d.name: d for d in self._pairing.book().paired}
        for record in self.trusted():
            device = devices.get(record.name)
            with self._lock:
                due = self._retry_at.get(record.fingerprint, 0.0) <= now
            if device is None or not due or not self._exchanges.ready(_endpoint(record)):
                continue
            if not needs_push(device, record.fingerprint):
                if record.fingerprint != device.fingerprint or not expires_soon(device):
                    continue
                device = self._pairing.renew(record.name)
            with self._lock:
                self._retry_at[record.fingerprint] = now + self._retries.renewal_retry_s
            renewal = CertificateRenewal(cert_pem=device.cert_pem)
            call = partial(self._agents.renew, address_of(record), renewal)
            self._exchanges.start(
                _endpoint(record), call, partial(_renewed, record.name, device.fingerprint)
            )

    def _prune_offers(self) -> None:
        """Drop pending offers whose key no unpaired device announces any more (withdrawn, or an
        offer for another key than the one announced), so they cannot fill the table."""
        live = [r for r in self._registry.devices() if not _paired(r)]
        announced = {(r.name, r.fingerprint[:16]) for r in live}
        for offer in self._pairing.book().pending:
            if (offer.name, offer.key_id) not in announced:
                self._pairing.discard_offer(offer.name, offer.key_id or "")
        with self._lock:
            self._offered &= {r.fingerprint for r in live}

    def _deliver_grants(self) -> list[Endpoint]:
        """Start sending each approved grant to every unpaired agent announcing its name, until
        the device announces itself paired with the issued certificate; returns the endpoints.

        Only the agent that shows the code can check the grant's proof and holds the key the
        certificate is for; a same-name rogue gets a certificate it cannot use, and cannot make
        the coordinator stop delivering to the real device.
        """
        with self._lock:
            waiting = dict(self._undelivered)
        started: list[Endpoint] = []
        for name, device in waiting.items():
            if any(r.fingerprint == device.fingerprint and _paired(r) for r in self.trusted()):
                log.warning("paired %s (certificate %s)", name, device.fingerprint[:16])
                with self._lock:
                    self._undelivered.pop(name, None)
                    self._grant_keys.pop(name, None)
                continue
            ca_pem = self._ca.cert_pem.decode()
            with self._lock:
                key = self._grant_keys.get(name, b"")
            proof = grant_proof(key, ca_pem, device.cert_pem)
            grant = PairingGrant(ca_pem=ca_pem, cert_pem=device.cert_pem, proof=proof)
            for record in self._registry.devices():
                if record.name != name or _paired(record):
                    continue
                call = partial(send_grant, address_of(record), grant)
                if self._exchanges.start(_endpoint(record), call, partial(_granted, name)):
                    started.append(_endpoint(record))
        return started

    def _push_revocations(self, force: bool, told: list[str] | None = None) -> list[Endpoint]:
        """Start sending the revocation list to every trusted agent that lacks it (``force``:
        to every one); each one told is recorded as it answers. Returns the endpoints."""
        book = self._pairing.book()
        revoked = Revocations(names=book.revoked_names, fingerprints=book.revoked_fingerprints)
        if not revoked.names and not revoked.fingerprints:
            return []
        started: list[Endpoint] = []
        for record in self.trusted():
            with self._lock:
                sent = self._revocations_sent.get(record.fingerprint) == revoked
            if sent and not force:
                continue
            call = partial(self._agents.revocations, address_of(record), revoked)
            done = partial(self._revocations_pushed, record, revoked, told)
            if self._exchanges.start(_endpoint(record), call, done):
                started.append(_endpoint(record))
        return started

    def _revocations_pushed(
        self,
        record: DeviceRecord,
        revoked: Revocations,
        told: list[str] | None,
        result: AgentStatus | AgentError,
    ) -> None:
        if isinstance(result, AgentError):
            log.warning("could not send the revocation list to %s: %s", record.name, result)
            return
        with self._lock:
            self._revocations_sent[record.fingerprint] = revoked
            if told is not None:
                told.append(record.name)


def _granted(name: str, result: AgentStatus | AgentError) -> None:
    if isinstance(result, AgentError):
        log.warning("could not deliver the certificate to %s: %s", name, result)


def _renewed(name: str, fingerprint: str, result: AgentStatus | AgentError) -> None:
    if isinstance(result, AgentError):
        log.warning("could not renew the certificate of %s: %s", name, result)
    else:
        log.warning("renewed the certificate of %s (%s)", name, fingerprint[:16])


def _endpoint(record: DeviceRecord) -> Endpoint:
    return (record.host, record.announcement.profile.control_port)


def _paired(record: DeviceRecord) -> bool:
    return record.announcement.state.paired
