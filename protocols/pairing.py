"""Pairing codes: a short code both the agent and the coordinator derive from the agent's key.

The operator compares the code the agent shows with the one the coordinator shows, then
approves; a certificate request whose key gives another code is refused.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Final

from pydantic import Field

from protocols.base import FrozenModel

CODE_CHARS: Final = 8
NODE_KEY_PATTERN: Final = r"^ecdsa-sha2-nistp(256|384|521) [A-Za-z0-9+/]+={0,2}$"
"""A Flower node-authentication public key: EC NIST, OpenSSH format, one line, no comment."""


def pairing_code(public_key_der: bytes) -> str:
    """``XXXX-XXXX`` from the SHA-256 of the public key (SubjectPublicKeyInfo DER), base32."""
    digest = hashlib.sha256(b"fedshard-pairing/1\n" + public_key_der).digest()
    text = base64.b32encode(digest[:5]).decode("ascii")[:CODE_CHARS]
    return f"{text[:4]}-{text[4:]}"


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
    code: str = Field(pattern=r"^[A-Z2-7]{4}-[A-Z2-7]{4}$")
    node_public_key: str | None = Field(default=None, max_length=1024, pattern=NODE_KEY_PATTERN)
    """The agent's Flower SuperNode authentication key, registered with the coordinator's
    SuperLink once the agent is paired (absent from agents that never train)."""


class PairingGrant(FrozenModel):
    """``POST /v1/pairing`` to an agent: the certificate the CA issued for its key, and the CA."""

    ca_pem: str = Field(max_length=16384)
    cert_pem: str = Field(max_length=16384)
