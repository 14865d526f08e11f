"""The agent's configuration: built once at the entry point and passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from edge_agent.errors import ConfigError
from protocols import sizes
from protocols.constants import DEFAULT_MAX_FRAME_BYTES, DEFAULT_QUEUE_DEPTH
from protocols.deploy import RESERVED_NAMES
from protocols.errors import SchemaError


def parse_size(text: str) -> int:
    """Parse ``64MiB``, ``1.5GB``, ``4096`` ... into bytes; raises ConfigError."""
    try:
        return sizes.parse_size(text)
    except SchemaError as exc:
        raise ConfigError(str(exc)) from exc


@dataclass(frozen=True)
class TlsFiles:
    """PEM files from the coordinator's pairing flow."""

    ca: Path
    cert: Path
    key: Path


def usable_cores() -> int:
    """The cores this process may run on: ``fedshard agent``'s intra-op threads unless told
    (one agent per device; several agents on one machine take ``--threads 1`` each)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class RuntimeConfig:
    """How ONNX Runtime sessions are built (the command line's default: :func:`usable_cores`
    intra-op threads; this class's, one, for agents sharing a machine)."""

    intra_op_threads: int = 1
    inter_op_threads: int = 1
    warmup_runs: int = 5

    def __post_init__(self) -> None:
        if self.intra_op_threads < 1 or self.inter_op_threads < 1:
            raise ConfigError("ONNX Runtime thread counts must be at least 1")


@dataclass(frozen=True)
class TrainConfig:
    """``--train-data``: also run a Flower SuperNode that fine-tunes on this device's data."""

    data_dir: Path
    """Holds ``data.npz`` (x, y) or text records (``*.jsonl``, ``*.txt``); never leaves."""
    superlink: str
    """``HOST:PORT`` of the coordinator's SuperLink (``fedshard train --superlink-port``)."""
    segments_dir: Path | None
    """The version being fine-tuned: its ``manifest.json`` and segment files; None: the copy
    the coordinator sends before each run (``STATE_DIR/training/current``)."""
    budget_bytes: int
    """Training-memory budget: decides which shards this device trains."""
    storage_bytes: int = 4 << 30
    """Largest copy of a version the coordinator may send (``--train-storage``)."""
    privacy_budget: float | None = None
    """``--privacy-budget``: the largest epsilon this device's privacy ledger may reach (None:
    no limit; the ledger still counts every round)."""
    allow_non_dp: bool = False
    """``--allow-non-dp``: train in rounds without record-level DP on the device."""
    allow_non_secagg: bool = False
    """``--allow-non-secagg``: send updates in rounds without SecAgg+."""


@dataclass(frozen=True)
class AgentConfig:
    """Everything ``fedshard agent`` was told."""

    name: str
    memory_bytes: int
    state_dir: Path
    interface: str = "127.0.0.1"
    control_port: int = 0
    """0 picks a free port."""
    data_port: int = 0
    tls: TlsFiles | None = None
    """None: unpaired; the agent advertises itself but every TLS handshake is refused."""
    runtime: RuntimeConfig = RuntimeConfig()
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_deploy_bytes: int = 1 << 31
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    """Bound of each stage queue (frames waiting for compute, results waiting to be sent)."""
    advertise: bool = True
    reprofile: bool = False
    """Measure GFLOP/s at start even when the state dir holds a cached profile."""
    training: TrainConfig | None = None
    """Run a Flower SuperNode beside the agent (``--train-data``)."""
    metrics_token: bytes | None = field(default=None, repr=False)
    """``--metrics-token-file``: a scraper that sends ``Authorization: Bearer TOKEN`` may read
    ``/v1/status`` and ``/metrics`` without the coordinator's certificate (None: only the
    coordinator may)."""

    def __post_init__(self) -> None:
        if self.name.lower() in RESERVED_NAMES:
            raise ConfigError(f"--name {self.name!r} is reserved for the coordinator")
        if self.memory_bytes <= 0:
            raise ConfigError("--memory must be positive")
        if self.queue_depth < 1:
            raise ConfigError("--queue-depth must be at least 1")
        if self.metrics_token is not None and len(self.metrics_token) < MIN_METRICS_TOKEN_BYTES:
            raise ConfigError(
                f"the metrics token must be at least {MIN_METRICS_TOKEN_BYTES} characters"
            )


MIN_METRICS_TOKEN_BYTES = 16
"""Shortest ``--metrics-token-file`` token accepted (``openssl rand -hex 32`` writes 64)."""


def read_metrics_token(path: Path) -> bytes:
    """The token in ``path`` (surrounding whitespace stripped): printable ASCII without spaces,
    at least :data:`MIN_METRICS_TOKEN_BYTES` long; raises ConfigError."""
    try:
        token = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read --metrics-token-file {path}: {exc}") from exc
    if not all(0x21 <= b <= 0x7E for b in token):
        raise ConfigError(f"--metrics-token-file {path}: the token must be printable ASCII")
    if len(token) < MIN_METRICS_TOKEN_BYTES:
        raise ConfigError(
            f"--metrics-token-file {path}: the token must be at least "
            f"{MIN_METRICS_TOKEN_BYTES} characters (e.g. `openssl rand -hex 32`)"
        )
    return token
