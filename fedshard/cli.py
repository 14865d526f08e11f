"""The ``fedshard`` command: one entry point; each package registers its own subcommands.

Each ``register`` function adds its subparser(s) and binds a handler with
``set_defaults(run=handler)``; a handler takes the parsed arguments and returns the exit code.
Modules are light to import: heavy dependencies (onnx, torch, fastapi) are imported inside the
handlers, so ``fedshard agent`` works on a device that installed only ``fedshard[agent]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import edge_agent.cli
from coordinator import commands as coord_cli
from coordinator.training import cli as train_cli
from devtools.demo import cli as demo_cli
from devtools.lab import cli as lab_cli
from partitioner.cli import plan_cli, split_cli
from protocols.constants import SOFTWARE_VERSION


def _digits_task(root: Path, num_clients: int) -> train_cli.LocalTask:
    """The reference task of ``fedshard train`` (imported when used: it needs onnx and torch)."""
    from devtools.digits import reference_task

    return reference_task(root, num_clients)


REGISTRATIONS = (
    plan_cli.register,
    split_cli.register,
    edge_agent.cli.register,
    lab_cli.register,
    partial(train_cli.register, reference_task=_digits_task),
    demo_cli.register,
    coord_cli.register,
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="fedshard",
        description="Run one neural network across the devices of a local network.",
    )
    parser.add_argument("--version", action="version", version=f"fedshard {SOFTWARE_VERSION}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in REGISTRATIONS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    args = build_parser().parse_args(argv)
    sys.exit(args.run(args))
