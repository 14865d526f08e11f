"""What a lab should look like: :class:`LabSpec`, and parsing of the command line's lists.

Per-host values (bandwidth, latency, memory, names) are given as comma-separated lists: one
value applies to every host, otherwise there must be exactly one value per host.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Final, TypeVar

from pydantic import Field, field_validator, model_validator

from devtools.lab.errors import LabSpecError
from protocols import sizes
from protocols.base import FrozenModel
from protocols.errors import SchemaError

LAB_NETWORK: Final = ipaddress.IPv4Network("10.77.0.0/16")
"""Every lab address lies in here; nothing of the lab ever leaves its namespaces."""
DEFAULT_SUBNET: Final = "10.77.0.0/24"
DEFAULT_MEMORY: Final = "256MiB"
MAX_HOSTS: Final = 200
RESERVED_NAMES: Final = frozenset({"ctl"})
"""``ctl`` is the lab's own namespace: the bridge and the coordinator's address."""

_NAME = r"^[a-z0-9][a-z0-9-]{0,30}$"
_UNSHAPED: Final = frozenset({"none", "-", "0", "inf", "unlimited"})

T = TypeVar("T")


class HostSpec(FrozenModel):
    """One host of the lab as requested."""

    name: str = Field(pattern=_NAME)
    bandwidth_mbps: float | None = Field(default=None, gt=0, le=100_000)
    """Egress and ingress rate of the host's link (tbf); None: unshaped."""
    latency_ms: float = Field(default=0.0, ge=0, le=10_000)
    """One-way latency of the host's link. Recorded only: the kernel has no netem here."""
    memory_bytes: int = Field(gt=0)
    """The memory budget given to the host's agent."""


class LabSpec(FrozenModel):
    """The whole lab: hosts on one bridge in one subnet, with or without agents."""

    hosts: tuple[HostSpec, ...] = Field(min_length=1, max_length=MAX_HOSTS)
    subnet: str = DEFAULT_SUBNET
    agents: bool = True

    @field_validator("subnet")
    @classmethod
    def _inside_lab_network(cls, value: str) -> str:
        try:
            net = ipaddress.IPv4Network(value, strict=True)
        except ValueError as exc:
            raise ValueError(f"not an IPv4 subnet: {exc}") from exc
        if not net.subnet_of(LAB_NETWORK) or net.prefixlen > 29:
            raise ValueError(f"subnet must lie in {LAB_NETWORK} with a prefix of /16 to /29")
        return str(net)

    @model_validator(mode="after")
    def _names_and_room(self) -> LabSpec:
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise ValueError("host names must be unique")
        reserved = RESERVED_NAMES.intersection(names)
        if reserved:
            raise ValueError(f"host name {sorted(reserved)[0]!r} is reserved")
        usable = ipaddress.IPv4Network(self.subnet).num_addresses - 2
        if len(self.hosts) + 1 > usable:
            raise ValueError(f"{self.subnet} has room for {usable - 1} hosts plus ctl")
        return self

    @classmethod
    def build(
        cls,
        count: int,
        *,
        bandwidth_mbps: str = "",
        latency_ms: str = "",
        memory: str = "",
        names: str = "",
        subnet: str = DEFAULT_SUBNET,
        agents: bool = True,
    ) -> LabSpec:
        """A spec from the command line's comma-separated lists; raises LabSpecError."""
        if not 1 <= count <= MAX_HOSTS:
            raise LabSpecError(f"a lab has 1 to {MAX_HOSTS} hosts, not {count}")
        bandwidths = expand(bandwidth_mbps, count, parse_bandwidth, None, "--bandwidth-mbps")
        latencies = expand(latency_ms, count, parse_latency, 0.0, "--latency-ms")
        memories = expand(memory, count, parse_size, parse_size(DEFAULT_MEMORY), "--memory")
        host_names = (
            [n.strip() for n in names.split(",")] if names else [f"h{i}" for i in range(count)]
        )
        if len(host_names) != count:
            raise LabSpecError(f"--names lists {len(host_names)} names for {count} hosts")
        try:
            return cls.from_obj(
                {
                    "hosts": [
                        {"name": n, "bandwidth_mbps": b, "latency_ms": lat, "memory_bytes": m}
                        for n, b, lat, m in zip(
                            host_names, bandwidths, latencies, memories, strict=True
                        )
                    ],
                    "subnet": subnet,
                    "agents": agents,
                }
            )
        except SchemaError as exc:
            raise LabSpecError(str(exc)) from exc


def expand(text: str, count: int, parse: Callable[[str], T], default: T, flag: str) -> list[T]:
    """``"a,b,c"`` to one parsed value per host: one value for all, or exactly ``count``."""
    if not text.strip():
        return [default] * count
    items = [item.strip() for item in text.split(",")]
    if len(items) not in (1, count):
        raise LabSpecError(f"{flag} takes one value or {count} values, not {len(items)}")
    values = [parse(item) for item in items]
    return values * count if len(values) == 1 else values


def parse_bandwidth(text: str) -> float | None:
    """Mbit/s as a positive number; ``none``/``0``/``-`` means unshaped."""
    if text.lower() in _UNSHAPED:
        return None
    value = _number(text, "bandwidth")
    if value <= 0:
        raise LabSpecError(f"bandwidth must be positive, not {text!r}")
    return value


def parse_latency(text: str) -> float:
    """Milliseconds, zero or more."""
    value = _number(text, "latency")
    if value < 0:
        raise LabSpecError(f"latency cannot be negative: {text!r}")
    return value


def parse_size(text: str) -> int:
    """``64MiB``, ``1.5GB``, ``4096`` ... in bytes; raises LabSpecError."""
    try:
        size = sizes.parse_size(text)
    except SchemaError as exc:
        raise LabSpecError(str(exc)) from exc
    if size <= 0:
        raise LabSpecError(f"memory must be positive, not {text!r}")
    return size


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise LabSpecError(f"{what} {text!r} is not a number") from exc
    if value != value or value in (float("inf"), float("-inf")):
        raise LabSpecError(f"{what} {text!r} is not finite")
    return value
