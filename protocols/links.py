"""Measured links between devices, shared by ``DEVICES.json`` and planning problems."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from pydantic import NonNegativeFloat, PositiveFloat

from protocols.base import FrozenModel


class Link(FrozenModel):
    """A measured link between two devices (undirected).

    Pairs without one use the smaller of the two devices' bandwidths and zero latency.
    """

    a: str
    b: str
    bandwidth_mbps: PositiveFloat
    latency_ms: NonNegativeFloat = 0.0


def check_links(device_names: Collection[str], links: Sequence[Link]) -> None:
    """Raise ValueError for a link to an unknown device, to itself, or given twice."""
    seen: set[frozenset[str]] = set()
    for link in links:
        if link.a not in device_names or link.b not in device_names:
            raise ValueError(f"link {link.a}-{link.b} names an unknown device")
        if link.a == link.b:
            raise ValueError(f"link {link.a}-{link.b} joins a device to itself")
        pair = frozenset((link.a, link.b))
        if pair in seen:
            raise ValueError(f"link {link.a}-{link.b} is given twice")
        seen.add(pair)
