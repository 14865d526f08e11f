"""The models of ``/v1/devices`` and ``/v1/pairing``, without FastAPI: the routes
(:mod:`coordinator.http.devices`) answer with them and :mod:`coordinator.client` reads them."""

from __future__ import annotations

from protocols.base import FrozenModel
from protocols.profile import Announcement


class DeviceView(FrozenModel):
    """One device as the API shows it."""

    name: str
    fingerprint: str
    host: str
    online: bool
    status: str
    """``paired``, ``unpaired``, ``revoked`` or ``impostor``."""
    announcement: Announcement


class ApproveBody(FrozenModel):
    """``POST /v1/pairing/approve``."""

    name: str
    code: str


class Approved(FrozenModel):
    """The reply to ``POST /v1/pairing/approve``: the device now paired."""

    name: str
    fingerprint: str


class RevokeBody(FrozenModel):
    """``POST /v1/pairing/revoke``."""

    name: str


class Revoked(FrozenModel):
    """The reply to ``POST /v1/pairing/revoke``: the device, and the agents told so."""

    revoked: str
    agents_told: list[str]
