"""``DEVICES.json``: the devices ``fedshard split`` plans for, as an operator writes them."""

from __future__ import annotations

from typing import Self

from pydantic import Field, NonNegativeInt, PositiveFloat, model_validator

from protocols.base import FrozenModel
from protocols.links import Link, Requester, check_links, check_requester
from protocols.roofs import RoofFields


class _DeviceSpecHead(FrozenModel):
    """The fields of a :class:`DeviceSpec` before its roofs."""

    name: str = Field(min_length=1)
    memory_bytes: NonNegativeInt
    gflops: PositiveFloat
    bandwidth_mbps: PositiveFloat


class DeviceSpec(RoofFields, _DeviceSpecHead):
    """One device: its memory budget, measured compute and network bandwidth."""

    # Its roofs beyond compute: RoofFields (optional; without them it is priced by FLOPs).


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
