"""``/v1/devices`` and ``/v1/pairing``: the fleet as the operator sees it, and pairing verbs.

Pairing errors are not mapped here: they propagate to the one catalogue
(:mod:`coordinator.http.errors`: wrong code and revoked 403, too many attempts 429 with
``Retry-After``, an unknown device 404).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter

from coordinator.http.device_models import (
    ApproveBody,
    Approved,
    DeviceView,
    RevokeBody,
    Revoked,
)
from coordinator.trust.pairing import PairingBook

if TYPE_CHECKING:
    from coordinator.http.app import Services


def device_status(book: PairingBook, name: str, fingerprint: str, impostor_of: str | None) -> str:
    """``revoked``, ``paired``, ``impostor`` or ``unpaired``."""
    if fingerprint in book.revoked_fingerprints or name in book.revoked_names:
        return "revoked"
    if any(
        d.name == name and fingerprint in (d.fingerprint, d.previous_fingerprint)
        for d in book.paired
    ):
        return "paired"
    if impostor_of is not None or any(d.name == name for d in book.paired):
        return "impostor"
    return "unpaired"


def devices_router(services: Services) -> APIRouter:
    """The device list and the pairing book, approve and revoke."""
    api = APIRouter()

    @api.get("/devices")
    def list_devices() -> list[DeviceView]:
        book = services.pairing.book()
        return [
            DeviceView(
                name=r.name,
                fingerprint=r.fingerprint,
                host=r.host,
                online=r.online,
                status=device_status(book, r.name, r.fingerprint, r.impostor_of),
                announcement=r.announcement,
            )
            for r in services.registry.devices(online_only=False)
        ]

    @api.get("/pairing")
    def pairing_book() -> PairingBook:
        return services.pairing.book()

    @api.post("/pairing/approve")
    def approve(body: ApproveBody) -> Approved:
        if services.trust is not None:
            device = services.trust.approve(body.name, body.code)
        else:
            device = services.pairing.approve(body.name, body.code)
        return Approved(name=device.name, fingerprint=device.fingerprint)

    @api.post("/pairing/revoke")
    def revoke(body: RevokeBody) -> Revoked:
        told: list[str] = []
        if services.trust is not None:
            told = services.trust.revoke(body.name)
        else:
            services.pairing.revoke(body.name)
        return Revoked(revoked=body.name, agents_told=told)

    return api
