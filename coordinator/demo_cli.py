"""``fedshard demo``: a newcomer's first run.

Until the full demo lands (coordinator and agents on loopback, issue 9), it shows that the
installed pieces work together: it exports all-MiniLM-L6-v2 from its package, plans it across
three uneven devices none of which can hold it alone, cuts it into ONNX segments, verifies the
chain against the whole model, and moves an activation through the frame codec.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

COMPONENTS = ("onnxruntime", "onnx", "zeroconf", "cryptography", "pydantic", "fastapi", "flwr")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``demo`` subcommand."""
    parser = subparsers.add_parser("demo", help="show fedshard working on this machine")
    parser.add_argument("--workdir", type=Path, help="keep the demo's files here")
    parser.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code."""
    console = Console()
    console.rule("[bold]fedshard demo")
    console.print(_versions_table())
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        return _run_steps(console, args.workdir)
    with tempfile.TemporaryDirectory(prefix="fedshard-demo-") as tmp:
        return _run_steps(console, Path(tmp))


def _run_steps(console: Console, workdir: Path) -> int:
    from coordinator.demo_steps import frame_round_trip, plan_and_split_minilm

    plan_and_split_minilm(console, workdir)
    frame_round_trip(console)
    console.print("[green]all pieces work[/green]")
    return 0


def _versions_table() -> Table:
    table = Table(title="installed components")
    table.add_column("component")
    table.add_column("version")
    for name in COMPONENTS:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "[yellow]not installed[/yellow]"
        table.add_row(name, version)
    return table
