"""The pure planning layer: from a :class:`~devtools.lab.spec.LabSpec` to names, addresses
and the exact ``ip``/``tc`` command lines that build the lab. No I/O here.

Topology. The lab's own namespace ``fs-<id>-ctl`` holds the bridge ``br0`` with the lab's last
usable address (the coordinator's place: run it there with ``fedshard lab exec ctl -- ...``).
Host ``i`` is namespace ``fs-<id>-<name>`` whose ``eth0`` is one end of a veth pair; the other
end, ``v<i>``, is a port of ``br0``. Every interface is created directly inside the lab's
namespaces (``ip -n ... link add ... peer ... netns ...``), so nothing of the lab ever appears in
the machine's own namespace, no namespace has a default route, and nothing is forwarded out.

Shaping. A host with a bandwidth gets a ``tbf`` on its ``eth0`` (what it sends) and on its
bridge port (what it receives), so the link between two hosts runs at the smaller of their two
rates, as ``DEVICES.json`` assumes for a missing link. This kernel has no ``netem``: latency
cannot be shaped, so each host's one-way latency is only recorded (state file,
:meth:`LabPlan.links`) for the application to add; the latency of a pair is the sum of both
hosts' latencies.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Final

from pydantic import Field

from devtools.lab.errors import LabSpecError
from devtools.lab.spec import LabSpec
from protocols.base import FrozenModel

NETNS_PREFIX: Final = "fs-"
CONTROL: Final = "ctl"
BRIDGE: Final = "br0"
HOST_IFACE: Final = "eth0"
IFNAMSIZ: Final = 15
"""Longest interface name the kernel accepts."""
TBF_LATENCY_MS: Final = 50
"""Longest a packet may wait in a tbf queue before it is dropped (sets the queue size)."""
_LAB_ID = r"^[0-9a-f]{4,8}$"


def new_lab_id() -> str:
    """A fresh random lab id (6 hex digits): namespaces of concurrent labs never collide."""
    return secrets.token_hex(3)


def lab_prefix(lab_id: str) -> str:
    """The prefix of every namespace of the lab ``lab_id``."""
    if not re.fullmatch(_LAB_ID, lab_id):
        raise LabSpecError(f"lab id must be 4 to 8 hex digits, not {lab_id!r}")
    return f"{NETNS_PREFIX}{lab_id}-"


@dataclass(frozen=True)
class Command:
    """One command line to run (never through a shell) and what it does."""

    argv: tuple[str, ...]
    what: str


class Node(FrozenModel):
    """A place in the lab: a namespace with one address on the lab's subnet."""

    name: str
    netns: str
    interface: str
    address: str
    prefixlen: int = Field(ge=16, le=29)


class HostPlan(Node):
    """A host: a node with a veth to the bridge, a link rate, a latency and a memory budget."""

    index: int = Field(ge=0)
    bridge_port: str
    bandwidth_mbps: float | None
    latency_ms: float
    memory_bytes: int


class LabPlan(FrozenModel):
    """Every name, address and command of one lab."""

    lab_id: str
    subnet: str
    control: Node
    hosts: tuple[HostPlan, ...]
    agents: bool

    @property
    def prefix(self) -> str:
        """Prefix shared by all of this lab's namespaces."""
        return lab_prefix(self.lab_id)

    def netns_names(self) -> tuple[str, ...]:
        """Every namespace of the lab, hosts first, then ``ctl`` (the order of removal)."""
        return (*(h.netns for h in self.hosts), self.control.netns)

    def node(self, name: str) -> Node:
        """The host called ``name``, or ``ctl``; raises LabSpecError for an unknown name."""
        if name == CONTROL:
            return self.control
        for host in self.hosts:
            if name in (host.name, host.netns):
                return host
        known = ", ".join([CONTROL, *(h.name for h in self.hosts)])
        raise LabSpecError(f"no host {name!r} in lab {self.lab_id} (hosts: {known})")

    def setup_commands(self) -> tuple[Command, ...]:
        """The ``ip``/``tc`` commands that build the lab, in order."""
        ctl = self.control
        commands = [
            Command(("ip", "netns", "add", ctl.netns), f"namespace {ctl.netns}"),
            Command(_ip(ctl.netns, "link", "set", "lo", "up"), "ctl loopback up"),
            Command(
                _ip(ctl.netns, "link", "add", BRIDGE, "type", "bridge", "mcast_snooping", "0"),
                "the lab bridge",
            ),
            Command(
                _ip(ctl.netns, "addr", "add", f"{ctl.address}/{ctl.prefixlen}", "dev", BRIDGE),
                f"ctl address {ctl.address}",
            ),
            Command(_ip(ctl.netns, "link", "set", BRIDGE, "up"), "bridge up"),
        ]
        for host in self.hosts:
            commands.extend(_host_commands(ctl.netns, host))
        return tuple(commands)

    def exec_argv(self, name: str, command: Sequence[str]) -> list[str]:
        """The argv that runs ``command`` inside the namespace of host ``name`` (or ``ctl``)."""
        return ["ip", "netns", "exec", self.node(name).netns, *command]

    def agent_argv(self, host: HostPlan, python: str, state_dir: Path) -> list[str]:
        """The argv of the edge agent of ``host``, run in its namespace on its lab address."""
        agent = [python, "-m", "edge_agent", "agent", "--name", host.name]
        agent += ["--memory", str(host.memory_bytes), "--state-dir", str(state_dir)]
        agent += ["--interface", host.address, "--threads", "1"]  # the hosts share the cores
        return self.exec_argv(host.name, agent)

    def links(self) -> list[dict[str, object]]:
        """Every host pair as a ``DEVICES.json`` link: the slower rate, the summed latency.

        ``bandwidth_mbps`` is None for a pair where neither host is shaped.
        """
        out: list[dict[str, object]] = []
        for a, b in combinations(self.hosts, 2):
            rates = [r for r in (a.bandwidth_mbps, b.bandwidth_mbps) if r is not None]
            out.append(
                {
                    "a": a.name,
                    "b": b.name,
                    "bandwidth_mbps": min(rates) if rates else None,
                    "latency_ms": a.latency_ms + b.latency_ms,
                }
            )
        return out


def plan_lab(spec: LabSpec, lab_id: str) -> LabPlan:
    """Names, addresses and ports for ``spec``; raises LabSpecError if a name would not fit."""
    prefix = lab_prefix(lab_id)
    net = ipaddress.IPv4Network(spec.subnet)
    usable = list(net.hosts())
    control = Node(
        name=CONTROL,
        netns=f"{prefix}{CONTROL}",
        interface=BRIDGE,
        address=str(usable[-1]),
        prefixlen=net.prefixlen,
    )
    hosts = []
    for index, host in enumerate(spec.hosts):
        port = f"v{index}"
        if len(port) > IFNAMSIZ:  # pragma: no cover - MAX_HOSTS keeps this short
            raise LabSpecError(f"interface name {port!r} is over {IFNAMSIZ} characters")
        hosts.append(
            HostPlan(
                name=host.name,
                netns=f"{prefix}{host.name}",
                interface=HOST_IFACE,
                address=str(usable[index]),
                prefixlen=net.prefixlen,
                index=index,
                bridge_port=port,
                bandwidth_mbps=host.bandwidth_mbps,
                latency_ms=host.latency_ms,
                memory_bytes=host.memory_bytes,
            )
        )
    return LabPlan(
        lab_id=lab_id, subnet=str(net), control=control, hosts=tuple(hosts), agents=spec.agents
    )


def tbf_args(rate_mbps: float) -> list[str]:
    """``tbf`` parameters for ``rate_mbps``: a burst of about 5 ms (at least 32 kB)."""
    rate_bytes = rate_mbps * 1e6 / 8
    burst = max(32_000, int(rate_bytes * 0.005))
    kbit = max(1, round(rate_mbps * 1000))
    return ["tbf", "rate", f"{kbit}kbit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]


def _ip(netns: str, *args: str) -> tuple[str, ...]:
    return ("ip", "-n", netns, *args)


def _host_commands(ctl_ns: str, host: HostPlan) -> list[Command]:
    ns, port = host.netns, host.bridge_port
    commands = [
        Command(("ip", "netns", "add", ns), f"namespace {ns}"),
        Command(_ip(ns, "link", "set", "lo", "up"), f"{host.name} loopback up"),
        Command(
            _ip(
                ctl_ns,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                host.interface,
                "netns",
                ns,
            ),
            f"veth {port} <-> {host.name}:{host.interface}",
        ),
        Command(_ip(ctl_ns, "link", "set", port, "master", BRIDGE), f"{port} on the bridge"),
        Command(_ip(ctl_ns, "link", "set", port, "up"), f"{port} up"),
        Command(
            _ip(ns, "addr", "add", f"{host.address}/{host.prefixlen}", "dev", host.interface),
            f"{host.name} address {host.address}",
        ),
        Command(_ip(ns, "link", "set", host.interface, "up"), f"{host.name} {host.interface} up"),
    ]
    if host.bandwidth_mbps is not None:
        tbf = tbf_args(host.bandwidth_mbps)
        commands += [
            Command(
                ("tc", "-n", ns, "qdisc", "add", "dev", host.interface, "root", *tbf),
                f"{host.name} sends at {host.bandwidth_mbps:g} Mbit/s",
            ),
            Command(
                ("tc", "-n", ctl_ns, "qdisc", "add", "dev", port, "root", *tbf),
                f"{host.name} receives at {host.bandwidth_mbps:g} Mbit/s",
            ),
        ]
    return commands
