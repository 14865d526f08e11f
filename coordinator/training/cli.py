"""``fedshard train``: federated fine-tuning rounds with Flower, SecAgg+ and DP, then rollout.

Without ``--version`` it runs the reference task the ``fedshard`` command hands it (the digits CNN
of :mod:`devtools.digits`: built, pre-trained on half the classes, cut into segments), and
``--clients`` local agents (SuperNode processes on 127.0.0.1, one per non-IID data split) train
it. With ``--version DIR`` it fine-tunes that version on the
agents paired with the coordinator of ``--state-dir``: the SuperLink it starts has node
authentication on and admits exactly the node keys those agents sent when they paired (address
and CA certificate are printed).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

DEFAULT_STATE_DIR = Path.home() / ".fedshard" / "coordinator"
SHARDS_LOCAL_EPOCHS = 2
"""``--local-epochs`` of a run without ``--model`` (with it, the coordinator decides)."""
SHARDS_LEARNING_RATE = 0.003
"""``--lr`` of a run without ``--model`` (with it, the coordinator decides)."""
SHARDS_BATCH_SIZE = 32
"""``--batch-size`` of a run without ``--model`` (with it, the coordinator decides)."""


class LocalTask(NamedTuple):
    """A training task prepared on this host: the version to train, test data, client data."""

    version_dir: Path
    test_file: Path
    client_dirs: list[Path]


ReferenceTask = Callable[[Path, int], LocalTask]
"""Prepares the reference task in a work dir for a number of clients (configured by the
``fedshard`` entry point, so this package never imports the task itself)."""


def register(subparsers: Any, reference_task: ReferenceTask | None = None) -> None:
    """Add the ``train`` subcommand; ``reference_task`` is what it trains without ``--version``."""
    p = subparsers.add_parser(
        "train",
        help="federated fine-tuning (Flower, SecAgg+, differential privacy)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=5, help="federated rounds (default 5)")
    p.add_argument("--clip", type=float, default=1.0, help="DP clipping norm of a client update")
    p.add_argument(
        "--noise-multiplier",
        type=float,
        default=0.05,
        help="DP noise multiplier z (noise std z*clip/clients); 0 turns DP off",
    )
    p.add_argument("--no-secagg", action="store_true", help="plain FedAvg uploads, no SecAgg+")
    p.add_argument(
        "--trainable-shards",
        type=int,
        nargs="+",
        metavar="INDEX",
        help="segment indices that may be trained (default: the last two)",
    )
    p.add_argument("--delta", type=float, default=1e-5, help="DP delta for the reported epsilon")
    p.add_argument(
        "--local-epochs",
        type=int,
        help=f"epochs a client trains each round (default {SHARDS_LOCAL_EPOCHS}; "
        "--model: the coordinator's default)",
    )
    p.add_argument(
        "--lr",
        "--learning-rate",
        dest="lr",
        type=float,
        help=f"client learning rate (default {SHARDS_LEARNING_RATE}; --model: the "
        "coordinator's default for the model and DP setting)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help=f"records a client step (default {SHARDS_BATCH_SIZE}; --model: the coordinator's "
        "default for the model, 16 for a decoder and 64 for an encoder)",
    )
    p.add_argument("--clients", type=int, default=3, help="clients per round (default 3)")
    p.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        metavar="BYTES",
        help="local agents' training budgets (default: the first fits only the head)",
    )
    p.add_argument("--version", type=Path, help="version directory to fine-tune")
    p.add_argument("--test-data", type=Path, help="held-out .npz (x, y) for --version")
    p.add_argument(
        "--superlink-port",
        type=int,
        default=0,
        help="fixed SuperLink port, for agents started with --train-superlink",
    )
    p.add_argument(
        "--interface", default="127.0.0.1", help="address the SuperLink listens on (--version)"
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help="the coordinator's state: its CA, and (--version) its paired agents' node keys",
    )
    p.add_argument("--work-dir", type=Path, default=Path("fedshard-train"))
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up")
    served = p.add_argument_group("LoRA of a served decoder (through the coordinator's API)")
    served.add_argument("--model", help="served model id: run a LoRA fine-tuning of it")
    served.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    served.add_argument("--alpha", type=float, help="LoRA alpha (default twice the rank)")
    served.add_argument("--first-layer", type=int, help="first adapted layer (default: middle)")
    served.add_argument("--coordinator", default="http://127.0.0.1:8470", help="API URL")
    served.add_argument("--token", default=os.environ.get("FEDSHARD_TOKEN"), help="API token")
    p.set_defaults(run=handler, reference_task=reference_task)


def handler(args: argparse.Namespace) -> int:
    """Run ``fedshard train``; returns the exit code."""
    import logging

    from rich.console import Console

    from coordinator.errors import CoordinatorError

    console = Console()
    logging.basicConfig(level=logging.WARNING)
    problem = _check(args)
    if problem:
        console.print(f"[red]error:[/] {problem}")
        return 2
    try:
        if args.model is not None:
            from coordinator.training.lora.cli import train_served

            return train_served(args, console)
        return _train(args, console)
    except CoordinatorError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1


def _check(args: argparse.Namespace) -> str | None:
    if args.rounds < 1:
        return "--rounds must be at least 1"
    if (
        (args.local_epochs is not None and args.local_epochs < 1)
        or (args.lr is not None and args.lr <= 0)
        or (args.batch_size is not None and args.batch_size < 1)
    ):
        return "--local-epochs, --learning-rate and --batch-size must be positive"
    if args.model is not None:
        return "--model runs on the coordinator's devices: no --version" if args.version else None
    if args.clip <= 0 or args.noise_multiplier < 0:
        return "--clip must be positive and --noise-multiplier not negative"
    if args.clients < 2 or (not args.no_secagg and args.clients < 3):
        return "SecAgg+ needs at least 3 clients (--clients), plain FedAvg at least 2"
    if (args.version is None) != (args.test_data is None):
        return "--version and --test-data go together"
    if args.version is None and getattr(args, "reference_task", None) is None:
        return "no reference task is configured here: give --version and --test-data"
    if args.budgets and len(args.budgets) != args.clients:
        return "--budgets needs one value per client"
    return None


def _train(args: argparse.Namespace, console: Any) -> int:
    from contextlib import ExitStack

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from coordinator.training.driver import roll_out, run_training
    from coordinator.training.local_agents import start_local_agents
    from coordinator.training.records import RoundMetrics, TrainingSettings
    from coordinator.training.runner import authenticated_superlink, paired_superlink
    from coordinator.training.version import Version
    from coordinator.trust.ca import CertificateAuthority
    from coordinator.trust.pairing import Pairing

    work: Path = args.work_dir.resolve()
    demo = args.version is None
    if demo:
        with console.status("preparing the reference task (the digits CNN, pre-trained)"):
            task = args.reference_task(work / "task", args.clients)
        version_dir, test_file = task.version_dir, task.test_file
    else:
        version_dir, test_file = args.version.resolve(), args.test_data.resolve()
    parent = Version.load(version_dir)
    shards = args.trainable_shards or list(
        range(max(0, len(parent.segments) - 2), len(parent.segments))
    )
    dp = args.noise_multiplier > 0
    settings = TrainingSettings(
        rounds=args.rounds,
        secagg=not args.no_secagg,
        clipping_norm=args.clip if dp else None,
        noise_multiplier=args.noise_multiplier if dp else None,
        delta=args.delta,
        trainable_shards=sorted(shards),
        local_epochs=SHARDS_LOCAL_EPOCHS if args.local_epochs is None else args.local_epochs,
        learning_rate=SHARDS_LEARNING_RATE if args.lr is None else args.lr,
        batch_size=SHARDS_BATCH_SIZE if args.batch_size is None else args.batch_size,
        min_clients=args.clients,
    )
    ca = CertificateAuthority.open(args.state_dir)
    run_dir = work / "runs" / time_stamp()
    with ExitStack() as stack:
        if demo:
            link, node_keys = stack.enter_context(
                authenticated_superlink(run_dir, ca, args.clients, args.superlink_port)
            )
        else:
            keys = Pairing(args.state_dir, ca).node_keys()
            link = stack.enter_context(
                paired_superlink(
                    run_dir, ca, keys, args.clients, args.superlink_port, args.interface
                )
            )
            console.print(f"node keys registered for: {', '.join(sorted(keys))}")
        console.print(f"SuperLink on [bold]{link.address}[/] (TLS, CA {link.tls.ca_cert})")
        if demo:
            budgets = args.budgets or [50_000] + [1 << 30] * (args.clients - 1)
            stack.enter_context(
                start_local_agents(link, version_dir, task.client_dirs, budgets, run_dir, node_keys)
            )
        progress = stack.enter_context(
            Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
            )
        )
        bar = progress.add_task("waiting for clients", total=args.rounds)

        def on_round(m: RoundMetrics) -> None:
            eps = f", ε {m.epsilon:.2f}" if m.epsilon is not None else ""
            progress.update(
                bar,
                advance=1,
                description=f"round {m.round}: accuracy {m.accuracy:.3f}{eps}, {m.clients} clients",
            )

        result = run_training(
            link,
            run_dir,
            version_dir,
            test_file,
            settings,
            population=args.clients,
            timeout_s=args.timeout,
            on_round=on_round,
        )
    child = roll_out(parent, result, version_dir.parent, signer=ca)
    console.print(rounds_table(result.record))
    console.print(f"new version [bold]{child.path}[/] (lineage in {child.path / 'lineage.json'})")
    return 0


def time_stamp() -> str:
    """UTC time as a directory name."""
    import datetime as dt

    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")


def rounds_table(record: Any) -> Any:
    """A rich table of a :class:`~coordinator.training.records.TrainingRecord`'s rounds."""
    from rich.table import Table

    table = Table(title=f"baseline accuracy {record.baseline_accuracy:.3f}")
    for col in ("round", "accuracy", "train loss", "epsilon", "clients", "upload B/client", "s"):
        table.add_column(col, justify="right")
    for m in record.rounds:
        table.add_row(
            str(m.round),
            f"{m.accuracy:.3f}",
            "-" if m.loss is None else f"{m.loss:.3f}",
            "-" if m.epsilon is None else f"{m.epsilon:.2f}",
            str(m.clients),
            f"{m.upload_bytes_per_client:,.0f}",
            f"{m.seconds:.1f}",
        )
    return table
