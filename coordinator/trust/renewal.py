"""Certificate renewal, coordinator side: paired agents get a new certificate before theirs expires.

Every poll of :class:`coordinator.trust.delivery.TrustService` looks at the trusted agents: one
whose certificate in the pairing book expires within :data:`RENEW_BEFORE` is issued a new one for
the same key, name and role (:meth:`coordinator.trust.pairing.Pairing.renew`, which keeps the old
fingerprint trusted meanwhile), and one still announcing the certificate its book entry renewed
is sent the new one (``POST /v1/certificate``) until it uses it, also after a restart.
"""

from __future__ import annotations

import datetime as dt

from cryptography import x509

from coordinator.trust.pairing import PairedDevice

RENEW_BEFORE = dt.timedelta(days=60)


def expires_soon(device: PairedDevice, now: dt.datetime | None = None) -> bool:
    """Whether ``device``'s certificate expires within :data:`RENEW_BEFORE`."""
    cert = x509.load_pem_x509_certificate(device.cert_pem.encode())
    return cert.not_valid_after_utc - (now or dt.datetime.now(dt.UTC)) <= RENEW_BEFORE


def needs_push(device: PairedDevice, announced_fingerprint: str) -> bool:
    """Whether the agent still announces the certificate ``device`` renewed."""
    return device.previous_fingerprint == announced_fingerprint != device.fingerprint
