"""``fedshard agent`` and ``fedshard profile``.

Light to import: ONNX Runtime, zeroconf and cryptography load inside the handlers.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from edge_agent.config import (
    AgentConfig,
    RuntimeConfig,
    TlsFiles,
    TrainConfig,
    parse_size,
    read_metrics_token,
    usable_cores,
)
from edge_agent.errors import AgentError, ConfigError
from protocols.constants import DEFAULT_QUEUE_DEPTH

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = Path.home() / ".fedshard" / "agent"
ALL_INTERFACES = "0.0.0.0"


def register(subparsers: Any) -> None:
    """Add the ``agent`` and ``profile`` subcommands."""
    agent = subparsers.add_parser(
        "agent",
        help="run the edge agent on this device",
        description="Advertise this device over mDNS and run a model segment when deployed.",
    )
    agent.add_argument("--name", required=True, help="device name (must match its certificate)")
    agent.add_argument("--memory", required=True, help="memory budget, e.g. 64MiB or 2GB")
    agent.add_argument(
        "--state-dir",
        type=Path,
        required=True,
        help="this agent's own files: key, pairing secret and certificate, cached profile, "
        "deployed segments (owner-only; keep it across restarts and upgrades)",
    )
    agent.add_argument(
        "--interface",
        default="127.0.0.1",
        help="IPv4 address this agent serves on and advertises over mDNS (default 127.0.0.1: "
        "only this machine, for a coordinator and agents on it; on a LAN give this device's "
        "address, e.g. 192.168.1.20, which the coordinator and the other agents connect to; "
        "not 0.0.0.0: one address is advertised)",
    )
    agent.add_argument(
        "--port",
        type=int,
        default=0,
        help="control port (default 0: any free port, fine without a host firewall; fix it, "
        "e.g. 8480, to open it and PORT+1 in one)",
    )
    agent.add_argument("--data-port", type=int, default=None, help="data port (default PORT+1)")
    agent.add_argument("--ca", type=Path, help="the coordinator's CA certificate (PEM)")
    agent.add_argument("--cert", type=Path, help="this agent's certificate (PEM)")
    agent.add_argument("--key", type=Path, help="this agent's private key (PEM)")
    agent.add_argument(
        "--queue-depth",
        type=int,
        default=DEFAULT_QUEUE_DEPTH,
        help=f"bound of each stage queue ({DEFAULT_QUEUE_DEPTH}, what the planner reserves for)",
    )
    agent.add_argument("--max-frame", default="256MiB", help="largest data-plane frame accepted")
    agent.add_argument("--no-advertise", action="store_true", help="do not announce over mDNS")
    agent.add_argument("--reprofile", action="store_true", help="re-measure GFLOP/s at start")
    agent.add_argument(
        "--metrics-token-file",
        type=Path,
        help="a file holding a token (at least 16 printable characters): a scraper that sends "
        "it as 'Authorization: Bearer TOKEN' may read /v1/status and /metrics over TLS "
        "without a client certificate (default: only the coordinator may)",
    )
    _add_runtime_args(agent)
    _add_train_args(agent)
    agent.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    agent.set_defaults(run=run_agent)

    profile = subparsers.add_parser(
        "profile",
        help="measure this device's compute (GFLOP/s) and cache it",
        description="Run the ONNX Runtime micro-benchmark and cache the result in the state dir.",
    )
    profile.add_argument(
        "--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="where the profile is cached"
    )
    profile.add_argument("--json", action="store_true", help="print the profile as JSON")
    _add_runtime_args(profile)
    profile.set_defaults(run=run_profile)


def _add_runtime_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=usable_cores(),
        help="ONNX Runtime intra-op threads (default: the cores this process may use, "
        "%(default)s here; several agents on one machine: 1 each)",
    )
    parser.add_argument(
        "--inter-op-threads", type=int, default=1, help="ONNX Runtime inter-op threads"
    )


def _add_train_args(parser: argparse.ArgumentParser) -> None:
    train = parser.add_argument_group("federated fine-tuning (needs fedshard[agent,train])")
    train.add_argument(
        "--train-data",
        type=Path,
        help="data.npz, or text records (*.jsonl, *.txt): also run a Flower SuperNode",
    )
    train.add_argument("--train-superlink", help="HOST:PORT of the coordinator's SuperLink")
    train.add_argument(
        "--train-segments",
        type=Path,
        help="the version being fine-tuned (default: the copy the coordinator sends each run)",
    )
    train.add_argument("--train-budget", help="training memory budget (default: --memory)")
    train.add_argument(
        "--train-storage", help="largest version copy the coordinator may send (default 4GiB)"
    )
    train.add_argument(
        "--privacy-budget",
        type=float,
        help="largest record-level epsilon this device's privacy ledger may reach; rounds past "
        "it are declined (default: no limit)",
    )
    train.add_argument(
        "--allow-non-dp", action="store_true", help="also train in rounds without DP-SGD"
    )
    train.add_argument(
        "--allow-non-secagg", action="store_true", help="also train in rounds without SecAgg+"
    )


def _train_config(args: argparse.Namespace, memory_bytes: int) -> TrainConfig | None:
    given = (args.train_superlink, args.train_segments, args.train_budget, args.train_storage)
    if args.train_data is None:
        if any(given):
            raise ConfigError(
                "--train-superlink, --train-segments, --train-budget and --train-storage "
                "need --train-data"
            )
        if args.privacy_budget is not None or args.allow_non_dp or args.allow_non_secagg:
            raise ConfigError(
                "--privacy-budget, --allow-non-dp and --allow-non-secagg need --train-data"
            )
        return None
    if not args.train_superlink:
        raise ConfigError("--train-data needs --train-superlink")
    data = args.train_data
    if not any(next(data.glob(pattern), None) for pattern in ("data.npz", "*.jsonl", "*.txt")):
        raise ConfigError(f"--train-data {data} holds no data.npz, *.jsonl or *.txt")
    budget = parse_size(args.train_budget) if args.train_budget else memory_bytes
    config = TrainConfig(data, args.train_superlink, args.train_segments, budget)
    if args.train_storage:
        config = dataclasses.replace(config, storage_bytes=parse_size(args.train_storage))
    if args.privacy_budget is not None and not args.privacy_budget > 0:
        raise ConfigError("--privacy-budget must be a positive epsilon")
    config = dataclasses.replace(
        config,
        privacy_budget=args.privacy_budget,
        allow_non_dp=args.allow_non_dp,
        allow_non_secagg=args.allow_non_secagg,
    )
    return config


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """Build the one AgentConfig from the command line; raises ConfigError."""
    if args.interface == ALL_INTERFACES:
        raise ConfigError(
            "--interface takes one address: the agent advertises it over mDNS and the "
            "coordinator and the other agents connect to it; give this device's LAN address"
        )
    tls_args = (args.ca, args.cert, args.key)
    if any(tls_args) and not all(tls_args):
        raise ConfigError("--ca, --cert and --key go together")
    tls = TlsFiles(args.ca, args.cert, args.key) if all(tls_args) else None
    data_port = (
        args.data_port if args.data_port is not None else (args.port + 1 if args.port else 0)
    )
    memory_bytes = parse_size(args.memory)
    return AgentConfig(
        name=args.name,
        memory_bytes=memory_bytes,
        state_dir=args.state_dir,
        interface=args.interface,
        control_port=args.port,
        data_port=data_port,
        tls=tls,
        runtime=RuntimeConfig(args.threads, args.inter_op_threads),
        max_frame_bytes=parse_size(args.max_frame),
        queue_depth=args.queue_depth,
        advertise=not args.no_advertise,
        reprofile=args.reprofile,
        training=_train_config(args, memory_bytes),
        metrics_token=(
            read_metrics_token(args.metrics_token_file) if args.metrics_token_file else None
        ),
    )


def private_state_dir(path: Path) -> None:
    """Create the state dir readable by its owner only (keys, pairing secret, segments)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


def run_agent(args: argparse.Namespace) -> int:
    """Handler of ``fedshard agent``."""
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args)
        private_state_dir(config.state_dir)
        # fedshard.cli imports this module: what fedshard[agent] brings stays out of its parser.
        # heavy: keeps onnxruntime, zeroconf and cryptography off a light install's `fedshard`
        from edge_agent.serve.service import serve

        if config.training is None:
            return serve(config)
        # heavy: keeps cryptography (fedshard[agent]) off a light install's `fedshard` parser
        from edge_agent.training.supernode import agent_supernode

        with agent_supernode(config):
            return serve(config)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    except (AgentError, OSError) as exc:
        log.error("agent failed: %s", exc)
        return 1


def run_profile(args: argparse.Namespace) -> int:
    """Handler of ``fedshard profile``: re-measure, cache, print."""
    from rich.console import Console
    from rich.table import Table

    # heavy: keeps onnxruntime (fedshard[agent]) off a light install's `fedshard` parser
    from edge_agent.profile.microbench import load_or_measure

    console = Console()
    try:
        runtime = RuntimeConfig(args.threads, args.inter_op_threads)
        profile = load_or_measure(args.state_dir, runtime, remeasure=True)
    except (ConfigError, OSError) as exc:
        console.print(f"[red]error:[/] cannot profile into {args.state_dir}: {exc}")
        return 2
    if args.json:
        console.print_json(profile.model_dump_json())
        return 0
    table = Table(title="fedshard profile")
    table.add_column("field")
    table.add_column("value", justify="right")
    for field, value in profile.model_dump().items():
        table.add_row(field, f"{value:.1f}" if isinstance(value, float) else str(value))
    console.print(table)
    return 0
