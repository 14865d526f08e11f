"""``DEVICES.json``: the devices ``fedshard split`` plans for, as an operator writes them."""

from __future__ import annotations

from typing import Self

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, model_validator

from protocols.base import FrozenModel


class DeviceSpec(FrozenModel):
    """One device: its memory budget, measured compute and network bandwidth."""

    name: str = Field(min_length=1)
    memory_bytes: NonNegativeInt
    gflops: PositiveFloat
    bandwidth_mbps: PositiveFloat


class DeviceLink(FrozenModel):
    """A measured link; pairs without one use the smaller bandwidth and zero latency."""

    a: str
    b: str
    bandwidth_mbps: PositiveFloat
    latency_ms: NonNegativeFloat = 0.0


class DeviceList(FrozenModel):
    """The whole ``DEVICES.json`` document."""

    devices: list[DeviceSpec] = Field(min_length=1)
    links: list[DeviceLink] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_names(self) -> Self:
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise ValueError("device names must be unique")
        seen: set[frozenset[str]] = set()
        for link in self.links:
            if link.a not in names or link.b not in names:
                raise ValueError(f"link {link.a}-{link.b} names an unknown device")
            if link.a == link.b:
                raise ValueError(f"link {link.a}-{link.b} joins a device to itself")
            pair = frozenset((link.a, link.b))
            if pair in seen:
                raise ValueError(f"link {link.a}-{link.b} is given twice")
            seen.add(pair)
        return self
