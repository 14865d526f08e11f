"""Measured links between devices, and from the requester to each device, shared by
``DEVICES.json`` and planning problems."""

from __future__ import annotations

import statistics
from collections.abc import Collection, Sequence

from pydantic import Field, NonNegativeFloat, PositiveFloat

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


class RequesterLink(FrozenModel):
    """The link between the requester (which sends inputs to the first stage and receives
    results from the last) and one device."""

    device: str
    bandwidth_mbps: PositiveFloat
    latency_ms: NonNegativeFloat = 0.0


class Requester(FrozenModel):
    """Where requests come from and results go back to (the coordinator).

    A device without a link entry is reached at its own ``bandwidth_mbps`` with zero latency.
    """

    links: list[RequesterLink] = Field(default_factory=list)


def check_requester(device_names: Collection[str], requester: Requester | None) -> None:
    """Raise ValueError for a requester link to an unknown device, or to one device twice."""
    if requester is None:
        return
    seen: set[str] = set()
    for link in requester.links:
        if link.device not in device_names:
            raise ValueError(f"requester link to {link.device!r} names an unknown device")
        if link.device in seen:
            raise ValueError(f"requester link to {link.device!r} is given twice")
        seen.add(link.device)


def probe_estimate(
    small_s: Sequence[float], large_s: Sequence[float], payload_bytes: int
) -> tuple[float, float]:
    """``(latency_ms, bandwidth_mbps)`` from probe round trips: header-only frames (``small_s``)
    and frames carrying ``payload_bytes`` (``large_s``), each answered by a header-only frame.

    Latency is half the median small round trip; the payload's time on the link is the median
    large round trip minus the median small one.
    """
    rtt = statistics.median(small_s)
    transfer = max(statistics.median(large_s) - rtt, 1e-9)
    return rtt / 2 * 1e3, payload_bytes * 8 / transfer / 1e6
