"""``DEVICES.json``: the devices ``fedshard split`` plans for, as an operator writes them."""

from __future__ import annotations

from typing import Self

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, model_validator

from protocols.base import FrozenModel
from protocols.links import Link, Requester, check_links, check_requester


class DeviceSpec(FrozenModel):
    """One device: its memory budget, measured compute and network bandwidth."""

    name: str = Field(min_length=1)
    memory_bytes: NonNegativeInt
    gflops: PositiveFloat
    bandwidth_mbps: PositiveFloat
    memory_gbps: PositiveFloat | None = None
    """Memory roof (streaming-read GB/s, as ``fedshard profile`` measures it). With it every
    unit is priced by the roofline, ``max(FLOPs / compute, bytes read / bandwidth)``; without
    it by FLOPs alone."""
    cache_bytes: NonNegativeInt = 0
    """Work reading at most this many bytes is priced at ``cache_gbps``."""
    cache_gbps: PositiveFloat | None = None
    """Streaming-read bandwidth within the cache, GB/s."""
    op_us: NonNegativeFloat = 0.0
    """Fixed cost of one operator, microseconds (roofline pricing only)."""
    call_us: NonNegativeFloat = 0.0
    """Fixed cost of one run of a segment, microseconds (roofline pricing only)."""
    topk_ns: NonNegativeFloat = 0.0
    """Cost of a ``TopK`` per element it selects from, nanoseconds (roofline pricing only)."""


class DeviceList(FrozenModel):
    """The whole ``DEVICES.json`` document."""

    devices: list[DeviceSpec] = Field(min_length=1)
    links: list[Link] = Field(default_factory=list)
    requester: Requester | None = None
    """The links from the requester (the coordinator) to the devices; ``None``: the planner
    does not count inputs in and results back."""

    @model_validator(mode="after")
    def _check_names(self) -> Self:
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise ValueError("device names must be unique")
        check_links(names, self.links)
        check_requester(names, self.requester)
        return self
