"""The coordinator's configuration: built once at the entry point and passed down."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from hostkit.files import write_atomic
from protocols import sizes
from protocols.errors import SchemaError

TOKEN_FILE = "api_token"
LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"
MDNS_PORT = 5353
API_PORT = 8470
"""The HTTP API's and console's port unless ``--port`` says otherwise."""
DEFAULT_API_URL = f"http://{LOOPBACK}:{API_PORT}"
"""Where the CLI verbs and clients find the API unless ``--coordinator`` says otherwise."""
API_TIMEOUT_S = 60.0
"""A client's wait for one API reply."""
API_DEPLOY_TIMEOUT_S = 900.0
"""A client's wait for ``POST /v1/deployments``: planning, cutting, pushing, warming up."""


@dataclass(frozen=True)
class AgentTrainingConfig:
    """``--superlink-port``: training runs go to the paired agents' SuperNodes."""

    superlink_port: int
    """Fixed port of the runs' SuperLink, on the coordinator's interface; agents are started
    with ``--train-superlink INTERFACE:PORT``."""
    clients: int = 3
    """Agents every round waits for."""


@dataclass(frozen=True)
class Timeouts:
    """How long the coordinator waits, in seconds: one place, built with
    :class:`CoordinatorConfig` and passed down to what waits."""

    request_s: float = 60.0
    """One inference run through a model's chain (:class:`~coordinator.serving.router.Router`)."""
    step_s: float = 60.0
    """One decoder step or speculative pass through the chain."""
    recovery_s: float = 60.0
    """A request's wait for the failover to hand out a servable version again."""
    connect_s: float = 10.0
    """Opening a data-plane connection to an agent (TLS handshake included)."""
    agent_call_s: float = 30.0
    """One control-plane call to a paired agent, unless the call says otherwise."""
    agent_deploy_s: float = 1800.0
    """One deploy to an agent (send the segment, load, warm up, answer), or one training file."""
    agent_metrics_s: float = 10.0
    """Reading an agent's ``/metrics`` (the console's stage rates)."""
    ping_s: float = 1.0
    """One liveness ping (``GET /v1/status``) of a paired agent
    (:class:`~coordinator.fleet.liveness.Liveness`)."""
    busy_grace_s: float = 60.0
    """How long a device that is being deployed to may miss pings before it is lost (it is
    loading its segment and may not answer)."""
    startup_grace_s: float = 5.0
    """How long after start a device the deployments expect may be absent before it is lost."""
    settle_s: float = 2.0
    """How long a lost device must answer every ping before it is back (no flapping)."""
    link_probe_s: float = 60.0
    """Measuring the coordinator's link to one agent, all probe rounds
    (:func:`~coordinator.fleet.requester_links.requester_probe`)."""
    link_reply_s: float = 10.0
    """One probe frame's answer while measuring that link."""
    mdns_resolve_s: float = 2.0
    """Resolving one agent's mDNS service record (:mod:`coordinator.fleet.discovery`)."""
    mdns_confirm_s: float = 3.0
    """How long a paired record stays online, unconfirmed, after its contested mDNS name
    departed (:class:`~coordinator.fleet.registry.DeviceRegistry`)."""
    unpaired_forget_s: float = 600.0
    """An offline record the pairing book does not hold is forgotten this long after it was
    last seen."""
    trust_delivery_s: float = 10.0
    """An approve or revoke's wait for its deliveries to the agents; the poller tells the others
    later (:class:`~coordinator.trust.delivery.TrustService`)."""


@dataclass(frozen=True)
class Retries:
    """When the coordinator tries again, or tells a refused caller to (``Retry-After``)."""

    unavailable_s: float = 15.0
    """A model the devices left cannot hold: re-planned again this often, and callers are told
    to come back after it."""
    ping_interval_s: float = 0.5
    """Liveness pings every paired agent this often (after a miss the next round starts at
    once)."""
    ping_misses: int = 2
    """Failed pings in a row after which a device is lost."""
    trust_poll_s: float = 0.5
    """The trust poller's round: offers, undelivered grants, renewals, revocation pushes."""
    renewal_retry_s: float = 5.0
    """A renewed certificate that did not reach its agent is sent again after this."""
    exchange_retry_s: float = 5.0
    """An agent that failed a trust exchange is not asked again for this long, doubling with
    each failure in a row up to :attr:`exchange_max_backoff_s`; an answer resets it."""
    exchange_max_backoff_s: float = 60.0
    """The longest wait between trust exchanges with an agent that keeps failing."""


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything ``fedshard coordinator`` was told."""

    state_dir: Path
    interface: str = LOOPBACK
    port: int = API_PORT
    token: str = ""
    agent_training: AgentTrainingConfig | None = None
    """None: training runs use local SuperNodes on the reference task's data splits."""
    segment_cache: Path | None = None
    """Segment files kept between deployments (None: ``STATE/segment-cache``)."""
    training_target: Path | None = None
    """What training runs fine-tune (a ``fedshard.training-target/1`` file; None: runs are 409)."""
    draft_threads: int = 1
    """ONNX Runtime intra-op threads of a draft model's call (``--draft-threads``)."""
    all_interfaces: bool = False
    """``--all-interfaces``: the HTTP API listens on every interface; mDNS stays on
    ``interface``."""
    open_docs: bool = False
    """``--open-docs``: ``/docs``, ``/redoc`` and ``/openapi.json`` need no token."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    retries: Retries = field(default_factory=Retries)

    @property
    def api_host(self) -> str:
        """The address the HTTP API listens on."""
        return ALL_INTERFACES if self.all_interfaces else self.interface

    def firewall_ports(self) -> list[str]:
        """What a host firewall must let in for this coordinator and its agents, one line each."""
        host = "every interface" if self.all_interfaces else self.interface
        lines = [
            f"tcp {self.port} on {host}: the HTTP API and console (clients, `fedshard pair`)",
            f"udp {MDNS_PORT} on {self.interface}: mDNS (multicast 224.0.0.251), to find agents",
        ]
        if self.agent_training is not None:
            lines.append(
                f"tcp {self.agent_training.superlink_port} on {self.interface}: the Flower "
                "SuperLink, for the agents' SuperNodes"
            )
        lines.append("on each agent: tcp its --port and --data-port (PORT+1), and udp 5353 (mDNS)")
        return lines

    @property
    def segment_cache_dir(self) -> Path:
        """Where segment files are kept between deployments."""
        return self.segment_cache or self.state_dir / "segment-cache"

    @property
    def console_url(self) -> str:
        """The console address with the login token, as printed at start."""
        return f"http://{self.interface}:{self.port}/?token={self.token}"


def binding_problem(interface: str, all_interfaces: bool, token: str) -> str | None:
    """Why the coordinator refuses to listen as told, or None.

    ``--interface`` is one address: mDNS browses on it and agents reach the API there, so the
    wildcard 0.0.0.0 is refused there and asked for with ``--all-interfaces``, which in turn
    is refused without an API token (every route but the console page needs it).
    """
    if interface == ALL_INTERFACES:
        return (
            "--interface takes one address (mDNS browses on it): give this machine's LAN "
            "address, and add --all-interfaces to serve the API on every interface"
        )
    if all_interfaces and not token:
        return f"--all-interfaces needs an API token: the state dir's {TOKEN_FILE} is empty"
    return None


def load_or_create_token(state_dir: Path) -> str:
    """The API token kept in the state dir (mode 0600), created on first start."""
    path = state_dir / TOKEN_FILE
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(24)
    while token.startswith("-"):  # `fedshard pair --token -x...` would read it as an option
        token = secrets.token_urlsafe(24)
    write_atomic(path, token.encode(), mode=0o600)
    return token


def parse_size(text: str) -> int:
    """``64MiB``, ``1.5GB``, ``4096`` ... in bytes (:func:`protocols.sizes.parse_size`);
    raises ValueError, as argparse types do."""
    try:
        return sizes.parse_size(text)
    except SchemaError as exc:
        raise ValueError(str(exc)) from exc
