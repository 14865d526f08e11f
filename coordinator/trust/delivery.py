"""Pairing and revocation as the running coordinator does them, over the agents' control planes.

:class:`TrustService` polls the registry: for every online agent that announces itself unpaired
(and is not revoked) it fetches the agent's :class:`~protocols.pairing.PairingOffer` and records
it as pending, with its code. Approving ``NAME CODE`` issues the certificate and POSTs the
:class:`~protocols.pairing.PairingGrant` to the agent (retried by the poller if the agent was
unreachable). Revoking pushes the complete revocation list to every paired agent, and to any
paired agent seen later, so every agent refuses the device on both planes.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from coordinator.errors import AgentError, PairingError
from coordinator.fleet.registry import DeviceRecord, DeviceRegistry
from coordinator.transport.agent_client import AgentAddress, AgentClient, fetch_offer, send_grant
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.offers import OfferTableFullError
from coordinator.trust.pairing import PairedDevice, Pairing
from coordinator.trust.renewal import expires_soon, needs_push
from protocols.deploy import CertificateRenewal, Revocations
from protocols.pairing import PairingGrant, PairingOffer, grant_proof

log = logging.getLogger(__name__)
POLL_INTERVAL_S = 0.5
FETCH_WORKERS = 8
RETRY_S = 5.0
"""After a failed offer fetch, the host is asked again this much later."""


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
    ) -> None:
        self._pairing = pairing
        self._registry = registry
        self._ca = ca
        self._agents = agents
        self._offered: set[str] = set()
        """Fingerprints of unpaired agents whose offer is recorded."""
        self._undelivered: dict[str, PairedDevice] = {}
        self._grant_keys: dict[str, bytes] = {}
        self._retry_at: dict[str, float] = {}
        """Fingerprint -> when a host whose offer could not be fetched is asked again."""
        """The key each undelivered grant proves knowledge of the code with."""
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
        """Issue ``name``'s certificate if ``code`` matches, and deliver it to the agent."""
        device, key = self._pairing.approve_with_key(name, code)
        with self._lock:
            self._undelivered[name] = device
            self._grant_keys[name] = key
        self._deliver_grants()
        return device

    def revoke(self, name: str) -> list[str]:
        """Revoke ``name`` and tell every paired agent; returns the agents that were told."""
        self._pairing.revoke(name)
        return self._push_revocations(force=True)

    def poll_once(self) -> None:
        """One round: collect offers, deliver grants, spread the revocation list."""
        self._collect_offers()
        self._deliver_grants()
        self._push_revocations(force=False)
        self._renew_certificates()

    def start(self) -> None:
        """Poll in a background thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="pairing-poller")
        self._thread.start()

    def stop(self) -> None:
        """Stop polling and join the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30.0)

    def _run(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_S):
            self.poll_once()

    def _collect_offers(self) -> None:
        """Fetch the offers of newly seen unpaired agents, all at once (each exchange has its
        own deadline, so a host that drips its answer delays nobody else), then record them."""
        self._prune_offers()
        book = self._pairing.book()
        paired = {d.name for d in book.paired}
        now = time.monotonic()
        wanted = [
            record
            for record in self._registry.devices()
            if not (
                record.announcement.state.paired
                or record.fingerprint in self._offered
                or self._retry_at.get(record.fingerprint, 0.0) > now
                or record.name in book.revoked_names
                or record.name in paired
            )
        ]
        if not wanted:
            return
        with ThreadPoolExecutor(min(len(wanted), FETCH_WORKERS)) as pool:
            fetched = list(pool.map(_fetch, wanted))
        for record, offer in zip(wanted, fetched, strict=True):
            if isinstance(offer, AgentError):
                self._retry_at[record.fingerprint] = time.monotonic() + RETRY_S
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
            self._offered.add(record.fingerprint)  # refused once, not fetched again
            log.warning("pairing offer from %s refused: %s", record.name, exc)
            return
        self._offered.add(record.fingerprint)
        log.warning("pairing request from %s (key %s)", record.name, key_id)

    def _renew_certificates(self) -> None:
        """Renew expiring certificates and send renewed ones (:mod:`coordinator.trust.renewal`)."""
        now = time.monotonic()
        devices = {d.name: d for d in self._pairing.book().paired}
        for record in self.trusted():
            device = devices.get(record.name)
            if device is None or self._retry_at.get(record.fingerprint, 0.0) > now:
                continue
            if not needs_push(device, record.fingerprint):
                if record.fingerprint != device.fingerprint or not expires_soon(device):
                    continue
                device = self._pairing.renew(record.name)
            self._retry_at[record.fingerprint] = now + RETRY_S
            try:
                self._agents.renew(address_of(record), CertificateRenewal(cert_pem=device.cert_pem))
            except AgentError as exc:
                log.warning("could not renew the certificate of %s: %s", record.name, exc)
                continue
            log.warning("renewed the certificate of %s (%s)", record.name, device.fingerprint[:16])

    def _prune_offers(self) -> None:
        """Drop pending offers whose key no unpaired device announces any more (withdrawn, or an
        offer for another key than the one announced), so they cannot fill the table."""
        live = [r for r in self._registry.devices() if not _paired(r)]
        announced = {(r.name, r.fingerprint[:16]) for r in live}
        for offer in self._pairing.book().pending:
            if (offer.name, offer.key_id) not in announced:
                self._pairing.discard_offer(offer.name, offer.key_id or "")
        self._offered &= {r.fingerprint for r in live}

    def _deliver_grants(self) -> None:
        """Send each approved grant to every unpaired agent announcing its name, until the
        device announces itself paired with the issued certificate.

        Only the agent that shows the code can check the grant's proof and holds the key the
        certificate is for; a same-name rogue gets a certificate it cannot use, and cannot make
        the coordinator stop delivering to the real device.
        """
        with self._lock:
            waiting = dict(self._undelivered)
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
                try:
                    send_grant(address_of(record), grant)
                except AgentError as exc:
                    log.warning("could not deliver the certificate to %s: %s", name, exc)

    def _push_revocations(self, force: bool) -> list[str]:
        book = self._pairing.book()
        revoked = Revocations(names=book.revoked_names, fingerprints=book.revoked_fingerprints)
        if not revoked.names and not revoked.fingerprints:
            return []
        told = []
        for record in self.trusted():
            if not force and self._revocations_sent.get(record.fingerprint) == revoked:
                continue
            try:
                self._agents.revocations(address_of(record), revoked)
            except AgentError as exc:
                log.warning("could not send the revocation list to %s: %s", record.name, exc)
                continue
            self._revocations_sent[record.fingerprint] = revoked
            told.append(record.name)
        return told


def _fetch(record: DeviceRecord) -> PairingOffer | AgentError:
    try:
        return fetch_offer(address_of(record))
    except AgentError as exc:
        return exc


def _paired(record: DeviceRecord) -> bool:
    return record.announcement.state.paired
