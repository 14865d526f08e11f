"""Pairing codes, and the proofs that bind an approval to the device that shows the code.

``fedshard.pairing/2``: an unpaired agent keeps a random secret and shows the code
:func:`secret_code` derives from it and its public key; the code never travels. Its offer
carries only a *commitment*: the SHA-256 of :func:`pairing_key`, a slow (scrypt) key derived from
the code and the public key, so the 40-bit code cannot be searched for offline from what the LAN
sees. The operator types the code the device shows; the coordinator derives the same key from it
and the offered public key, and approves only the offer whose commitment matches (a same-name
rogue's offer does not). Its grant carries :func:`grant_proof`, an HMAC with that key over the
certificates, and the agent accepts only a grant whose proof checks: a foreign CA, which never
saw the code, cannot capture an unpaired agent.

:func:`pairing_code` (``fedshard.pairing/1``, derived from the public key alone) is kept for
reading old offers; new agents do not send a code.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from typing import Final

from pydantic import Field

from protocols.base import FrozenModel

CODE_CHARS: Final = 8
SECRET_BYTES: Final = 16
CODE_FILE: Final = "pairing-code"
"""Where an unpaired agent writes the code it shows, in its state dir (mode 0600)."""
HEX64: Final = r"^[0-9a-f]{64}$"
SCRYPT_N: Final = 1 << 14
"""scrypt cost (16 MiB, tens of ms per code): searching 2^40 codes offline is out of reach."""
NODE_KEY_PATTERN: Final = r"^ecdsa-sha2-nistp(256|384|521) [A-Za-z0-9+/]+={0,2}$"
"""A Flower node-authentication public key: EC NIST, OpenSSH format, one line, no comment."""


def pairing_code(public_key_der: bytes) -> str:
    """``XXXX-XXXX`` from the SHA-256 of the public key (SubjectPublicKeyInfo DER), base32."""
    digest = hashlib.sha256(b"fedshard-pairing/1\n" + public_key_der).digest()
    text = base64.b32encode(digest[:5]).decode("ascii")[:CODE_CHARS]
    return f"{text[:4]}-{text[4:]}"


def new_secret() -> bytes:
    """A fresh random pairing secret (kept by the agent, never sent)."""
    return secrets.token_bytes(SECRET_BYTES)


def secret_code(secret: bytes, public_key_der: bytes) -> str:
    """``XXXX-XXXX``: the code an agent shows, from its secret and its public key (SPKI DER)."""
    digest = hmac.new(secret, b"fedshard-pairing/2 code\n" + public_key_der, "sha256").digest()
    text = base64.b32encode(digest[:5]).decode("ascii")[:CODE_CHARS]
    return f"{text[:4]}-{text[4:]}"


def pairing_key(code: str, public_key_der: bytes) -> bytes:
    """The 32-byte key both sides derive from the code and the agent's public key (scrypt)."""
    salt = b"fedshard-pairing/2\n" + hashlib.sha256(public_key_der).digest()
    password = normalise_code(code).encode()
    return hashlib.scrypt(password, salt=salt, n=SCRYPT_N, r=8, p=1, dklen=32)


def commitment(key: bytes) -> str:
    """What an offer carries in place of the code: the SHA-256 of :func:`pairing_key`, hex."""
    return hashlib.sha256(b"fedshard-pairing/2 commit\n" + key).hexdigest()


def grant_proof(key: bytes, ca_pem: str, cert_pem: str) -> str:
    """HMAC-SHA256 with :func:`pairing_key` over both certificates of a grant, hex."""
    message = b"fedshard-pairing/2 grant\n"
    message += hashlib.sha256(ca_pem.encode()).digest() + hashlib.sha256(cert_pem.encode()).digest()
    return hmac.new(key, message, "sha256").hexdigest()


def proof_matches(key: bytes, grant: PairingGrant) -> bool:
    """Whether a grant proves knowledge of the code ``key`` was derived from (constant time)."""
    if grant.proof is None:
        return False
    expected = grant_proof(key, grant.ca_pem, grant.cert_pem)
    return hmac.compare_digest(expected.encode(), grant.proof.encode())


def normalise_code(code: str) -> str:
    """Accept what people type: any case, with or without the dash or spaces."""
    text = "".join(ch for ch in code.upper() if ch.isalnum())
    return f"{text[:4]}-{text[4:]}" if len(text) == CODE_CHARS else text


def codes_match(expected: str, typed: str) -> bool:
    """Constant-time comparison of a typed code with the expected one."""
    return hmac.compare_digest(normalise_code(expected).encode(), normalise_code(typed).encode())


class PairingOffer(FrozenModel):
    """``GET /v1/pairing`` on an unpaired agent: its certificate request and the code it shows."""

    name: str = Field(min_length=1, max_length=63)
    csr_pem: str = Field(max_length=16384)
    code: str | None = Field(default=None, pattern=r"^[A-Z2-7]{4}-[A-Z2-7]{4}$")
    """``fedshard.pairing/1`` only (a code derived from the public key); absent from new agents,
    whose code is secret and shown on the device."""
    commitment: str | None = Field(default=None, pattern=HEX64)
    """``fedshard.pairing/2``: :func:`commitment` of :func:`pairing_key`; the coordinator
    approves only an offer whose commitment matches the code the operator typed."""
    node_public_key: str | None = Field(default=None, max_length=1024, pattern=NODE_KEY_PATTERN)
    """The agent's Flower SuperNode authentication key, registered with the coordinator's
    SuperLink once the agent is paired (absent from agents that never train)."""


class PairingGrant(FrozenModel):
    """``POST /v1/pairing`` to an agent: the certificate the CA issued for its key, and the CA."""

    ca_pem: str = Field(max_length=16384)
    cert_pem: str = Field(max_length=16384)
    proof: str | None = Field(default=None, pattern=HEX64)
    """:func:`grant_proof` over both certificates; an agent refuses a grant without a valid one."""
