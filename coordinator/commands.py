"""``fedshard coordinator``, ``pair``, ``revoke``, ``deploy``, ``rollback`` and ``devices``.

``coordinator`` runs the service; the others are thin clients of its HTTP API (token from
``--token`` or ``FEDSHARD_TOKEN``). Light to import: FastAPI, uvicorn and httpx load inside the
handlers.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from coordinator.config import (
    API_PORT,
    DEFAULT_API_URL,
    AgentTrainingConfig,
    CoordinatorConfig,
    binding_problem,
    load_or_create_token,
    parse_size,
)
from coordinator.errors import ApiError, CoordinatorError

if TYPE_CHECKING:
    from coordinator.client import CoordinatorClient

PAIR_WAIT_S = 30.0


def register(subparsers: Any) -> None:
    """Add the coordinator's subcommands."""
    run = subparsers.add_parser(
        "coordinator",
        help="run the coordinator (pairing, registry, deploy, inference API)",
        description="Pair agents, keep the device registry live, deploy and serve models.",
    )
    run.add_argument("--state-dir", type=Path, required=True, help="CA, pairings, deployments")
    run.add_argument(
        "--interface",
        default="127.0.0.1",
        help="IPv4 address the HTTP API listens on and mDNS browses for agents on (default "
        "127.0.0.1: only this machine, safe until you mean to serve a LAN; agents on other "
        "devices are found only when this is this machine's LAN address, e.g. 192.168.1.10)",
    )
    run.add_argument(
        "--all-interfaces",
        action="store_true",
        help="let the HTTP API listen on every interface (0.0.0.0) while mDNS browses on "
        "--interface; refused without an API token (the state dir's api_token)",
    )
    run.add_argument(
        "--port", type=int, default=API_PORT, help=f"HTTP API and console port (default {API_PORT})"
    )
    run.add_argument(
        "--open-docs",
        action="store_true",
        help="serve the API's description (/docs, /redoc, /openapi.json) without the token "
        "(default: it needs the token, as the API does)",
    )
    run.add_argument(
        "--superlink-port",
        type=int,
        help="train on paired agents: their SuperNodes connect to a SuperLink on this port"
        " (node authentication on); without it, runs use local SuperNodes",
    )
    run.add_argument(
        "--train-clients", type=int, default=3, help="agents each training round waits for"
    )
    run.add_argument(
        "--segment-cache",
        type=Path,
        help="keep cut segment files here and reuse them when a model is cut the same way "
        "again (default: STATE/segment-cache, at most 8 GiB)",
    )
    run.add_argument(
        "--training-target",
        type=Path,
        metavar="FILE",
        help="what training runs fine-tune (a fedshard.training-target/1 JSON file; "
        "`fedshard demo` writes one for the digits task); without it, runs are refused (409)",
    )
    run.add_argument(
        "--draft-threads",
        type=_positive_int,
        default=default_draft_threads(),
        help="ONNX Runtime threads of a draft model's call (speculative: draft or auto; "
        "default: half this machine's cores, at most 4, leaving the rest to serving and to "
        "an agent on the same machine)",
    )
    run.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    run.set_defaults(run=run_coordinator)

    pair = _client_parser(subparsers, "pair", "approve an agent's pairing request by its code")
    pair.add_argument("name", help="device name the agent announces")
    pair.add_argument("code", help="the pairing code the agent shows (XXXX-XXXX)")
    pair.add_argument("--wait", type=float, default=PAIR_WAIT_S, help="seconds to wait for it")
    pair.set_defaults(run=run_pair)

    revoke = _client_parser(subparsers, "revoke", "refuse a device everywhere from now on")
    revoke.add_argument("name", help="device name")
    revoke.set_defaults(run=run_revoke)

    deploy = _client_parser(subparsers, "deploy", "plan, split, push and switch to a model")
    deploy.add_argument("model", type=Path, help="ONNX or GGUF file (on the coordinator's host)")
    deploy.add_argument("--objective", choices=["throughput", "latency"], default="throughput")
    deploy.add_argument("--name", help="model id (default: from the file name)")
    deploy.add_argument(
        "--memory-cap",
        action="append",
        default=[],
        metavar="DEVICE=SIZE",
        help="plan with at most SIZE on DEVICE (repeatable)",
    )
    deploy.add_argument("--tokenizer", type=Path, help="tokenizer directory of a text encoder")
    deploy.add_argument(
        "--speculative",
        choices=["off", "lookup", "draft", "auto"],
        help="a decoder's speculative decoding (default: auto for a new model)",
    )
    deploy.add_argument(
        "--draft-model",
        type=Path,
        help="export directory of a draft model with the same tokenizer (for draft and auto)",
    )
    deploy.add_argument(
        "--weights",
        choices=["keep", "int4", "int8"],
        default="keep",
        help="a GGUF file's weights in its segments: its own types (keep, the default) or "
        "re-quantized per tensor",
    )
    deploy.set_defaults(run=run_deploy)

    rollback = _client_parser(subparsers, "rollback", "switch a model back to its last version")
    rollback.add_argument("model_id", help="model id, e.g. all-minilm-l6-v2")
    rollback.set_defaults(run=run_rollback)

    devices = _client_parser(subparsers, "devices", "list the devices the coordinator sees")
    devices.set_defaults(run=run_devices)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def default_draft_threads() -> int:
    """A draft model's threads unless told: half the machine's cores (at least 1, at most 4).
    The drafter shares the machine with the coordinator's own serving and often with an agent;
    on 2 cores beside three agents, one thread gave four streams on chat 1.27x-1.37x where two
    gave 0.99x-1.10x, and one stream 1.14x-1.27x where two gave 1.22x-1.23x
    (``bench/generate.py``, README "Interleaved runs")."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def _client_parser(subparsers: Any, name: str, text: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(name, help=text, description=text)
    parser.add_argument("--coordinator", default=DEFAULT_API_URL, help="coordinator API URL")
    parser.add_argument("--token", default=os.environ.get("FEDSHARD_TOKEN"), help="API token")
    return parser


def run_coordinator(args: argparse.Namespace) -> int:
    """Handler of ``fedshard coordinator``."""
    # The fedshard parser imports this module on agent-only installs too (test_cli_light.py).
    # heavy: coordinator.app brings FastAPI, Flower and onnx
    from coordinator.app import serve

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    console = Console()
    try:
        state_dir = args.state_dir.expanduser().resolve()
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        token = load_or_create_token(state_dir)
        refused = binding_problem(args.interface, args.all_interfaces, token)
        if refused is not None:
            console.print(f"[red]coordinator refused:[/] {refused}")
            return 2
        training = None
        if args.superlink_port is not None:
            training = AgentTrainingConfig(args.superlink_port, args.train_clients)
        target = args.training_target.expanduser().resolve() if args.training_target else None
        config = CoordinatorConfig(
            state_dir, args.interface, args.port, token, training, args.segment_cache, target,
            args.draft_threads, args.all_interfaces, args.open_docs,
        )  # fmt: skip
        return serve(config, console)
    except (CoordinatorError, OSError) as exc:
        console.print(f"[red]coordinator failed:[/] {exc}")
        return 1


def run_pair(args: argparse.Namespace) -> int:
    """Handler of ``fedshard pair``: retries while the agent's request has not arrived yet."""
    deadline = time.monotonic() + args.wait
    client = _client(args)
    while True:
        try:
            client.approve(args.name, args.code)
        except ApiError as exc:
            if exc.status != 404 or time.monotonic() > deadline:
                return _failed(exc)
            time.sleep(0.5)
        else:
            return _done(f"paired {args.name}")


def run_revoke(args: argparse.Namespace) -> int:
    """Handler of ``fedshard revoke``."""
    try:
        _client(args).revoke(args.name)
    except ApiError as exc:
        return _failed(exc)
    return _done(f"revoked {args.name}")


LOG_WIDTH = 140
"""Columns the plan tables are written in when the output is no terminal (rich's default there
is 80, which abridges their numbers)."""


def wide_when_piped(console: Console) -> Console:
    """``console``, :data:`LOG_WIDTH` columns wide when it writes to no terminal."""
    if not console.is_terminal:
        console.width = LOG_WIDTH
    return console


def run_deploy(args: argparse.Namespace) -> int:
    """Handler of ``fedshard deploy``."""
    console = wide_when_piped(Console())
    caps = {}
    try:
        for item in args.memory_cap:
            device, _, size = item.partition("=")
            caps[device] = parse_size(size)
    except ValueError as exc:
        console.print(f"[red]error:[/] --memory-cap: {exc}")
        return 2
    body: dict[str, Any] = {
        "model_path": str(args.model.expanduser().resolve()),
        "objective": args.objective,
        "memory_caps": caps,
    }
    if args.name:
        body["model_id"] = args.name
    if args.tokenizer:
        body["tokenizer_dir"] = str(args.tokenizer.expanduser().resolve())
    if args.speculative:
        body["speculative"] = args.speculative
    if args.draft_model:
        body["draft_model"] = str(args.draft_model.expanduser().resolve())
    if args.weights != "keep":
        body["weights"] = args.weights
    try:
        version = _client(args).deploy(body)
    except ApiError as exc:
        return _failed(exc)
    _print_version(console, version.model_dump(mode="json"))
    return _done(f"deployed {version.model_id} v{version.version}")


def run_rollback(args: argparse.Namespace) -> int:
    """Handler of ``fedshard rollback``."""
    try:
        version = _client(args).rollback(args.model_id)
    except ApiError as exc:
        return _failed(exc)
    return _done(f"{args.model_id} now at v{version.version}")


def run_devices(args: argparse.Namespace) -> int:
    """Handler of ``fedshard devices``."""
    from rich.table import Table

    try:
        devices = _client(args).devices()
    except ApiError as exc:
        return _failed(exc)
    table = Table(title="devices")
    for column in ("name", "status", "online", "host", "memory", "GFLOP/s"):
        table.add_column(column)
    for device in devices:
        profile = device.announcement.profile
        table.add_row(
            device.name,
            device.status,
            str(device.online),
            device.host,
            f"{profile.memory_bytes / 2**20:.0f} MiB",
            f"{profile.gflops:.1f}",
        )
    Console().print(table)
    return 0


def _client(args: argparse.Namespace) -> CoordinatorClient:
    """The API client of ``--coordinator`` and ``--token``."""
    # heavy: the client needs httpx, not on an agent-only install (test_cli_light.py)
    from coordinator.client import CoordinatorClient

    return CoordinatorClient(args.coordinator, args.token)


def _done(success: str) -> int:
    Console().print(f"[green]{success}[/]")
    return 0


def _failed(error: ApiError) -> int:
    Console().print(f"[red]error ({error.status or 'no connection'}):[/] {error.detail}")
    return 1


PLACEMENT_COLUMNS = (
    "pred. MB",
    "KV MB",
    "meas. MB",
    "MB pred./meas.",
    "pred. ms",
    "meas. ms",
    "ms pred./meas.",
    "prefill ms",
)
"""The headers of :func:`placement_cells`."""


def _print_version(console: Console, version: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"{version['model_id']} v{version['version']}: plan next to reality")
    for column in ("segment", "device", *PLACEMENT_COLUMNS):
        table.add_column(column, justify="right")
    for p in version["segments"]:
        table.add_row(str(p["index"]), p["device"], *placement_cells(p))
    console.print(table)
    card = version.get("card")
    if card:
        console.print(gguf_lines(card))


def gguf_lines(card: dict[str, Any]) -> str:
    """What a deployed GGUF file is and what building its segments cost, in a few lines."""
    mix = ", ".join(
        f"{kind} {count / max(card['parameters'], 1):.0%}"
        for kind, count in card["quantization"].items()
    )
    lines = [
        f"{card['file']}: {card.get('name') or '-'} ({card['architecture']}, "
        f"{card['parameters'] / 1e6:.1f} M parameters, {card['layers']} layers; {mix}; "
        f"weights {card['weights']})"
    ]
    build = card.get("build")
    if build:
        deploy = build.get("deploy_peak_rss_bytes")
        through = "" if deploy is None else f", {deploy / 1e6:.1f} MB through push and check"
        lines.append(
            f"coordinator: peak resident memory {build['peak_rss_bytes'] / 1e6:.1f} MB while "
            f"building{through}; file {card['file_bytes'] / 1e6:.1f} MB, largest segment "
            f"{build['largest_segment_bytes'] / 1e6:.1f} MB ({build['seconds']:.1f} s to build)"
        )
    return "\n".join(lines)


def placement_cells(placement: dict[str, Any]) -> list[str]:
    """A placement's plan-next-to-reality cells (:data:`PLACEMENT_COLUMNS`): the memory the
    plan predicts loading the segment takes next to the memory it reserves for the sessions'
    KV cache (allocated per session, so not in the measured resident memory after loading), the
    measured memory and the ratio of the first to it; the predicted and measured stage time (ms)
    and their ratio; the predicted prefill (ms; ``-`` for encoders)."""
    prefill = placement.get("predicted_prefill_s")
    predicted, measured = placement["predicted_compute_s"], placement["warmup_s"]
    state = int(placement.get("state_bytes", 0))
    loaded, resident = (
        placement["predicted_memory_bytes"] - state,
        placement["measured_memory_bytes"],
    )
    return [
        f"{loaded / 1e6:.1f}",
        f"{state / 1e6:.1f}",
        f"{resident / 1e6:.1f}",
        f"{loaded / resident:.2f}" if resident > 0 else "-",
        f"{predicted * 1e3:.2f}",
        f"{measured * 1e3:.2f}",
        f"{predicted / measured:.2f}" if measured > 0 else "-",
        "-" if prefill is None else f"{prefill * 1e3:.2f}",
    ]
