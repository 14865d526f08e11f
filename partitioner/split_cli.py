"""``fedshard split`` and ``fedshard export``: the partitioner's file-level commands.

Importing this module is cheap: onnx, onnxruntime and torch are imported inside the handlers.

Exit codes of ``split``: 0 done, 1 bad input (model, devices, samples), 3 no arrangement of the
devices holds the model, 4 ``--verify`` found the chain differs from the whole model.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

EXIT_BAD_INPUT = 1
EXIT_INFEASIBLE = 3
EXIT_VERIFY_FAILED = 4


def register(subparsers: Any) -> None:
    """Add the ``split`` and ``export`` subcommands to an argparse subparsers object."""
    split = subparsers.add_parser(
        "split",
        help="cut an ONNX model into per-device segments and write a manifest",
        description=(
            "Plan MODEL onto the devices of DEVICES.json, write one ONNX file per segment and "
            "DIR/manifest.json. Exit codes: 0 done, 1 bad input, 3 infeasible, 4 verify failed."
        ),
    )
    split.add_argument("model", type=Path, metavar="MODEL.onnx")
    split.add_argument("--devices", type=Path, required=True, metavar="DEVICES.json")
    split.add_argument("--out", type=Path, required=True, metavar="DIR")
    split.add_argument("--objective", choices=["throughput", "latency"], default="throughput")
    split.add_argument("--queue-depth", type=int, default=2, metavar="N")
    split.add_argument(
        "--verify", action="store_true", help="run the chain in ONNX Runtime and compare"
    )
    split.add_argument("--tolerance", type=float, default=1e-5, help="max abs diff for --verify")
    split.add_argument(
        "--inputs", type=Path, metavar="SAMPLES.npz", help="sample inputs (default: embedded)"
    )
    split.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="bind a symbolic dimension for costing and synthesised inputs",
    )
    split.add_argument("--max-units", type=int, default=128, metavar="N")
    split.add_argument(
        "--direct-io",
        action="store_true",
        help="feed model inputs straight to the segments using them (no pass-through)",
    )
    split.set_defaults(run=run_split)

    export = subparsers.add_parser(
        "export",
        help="export a packaged model to ONNX",
        description="Export a packaged model (real weights) to ONNX with dynamic axes.",
    )
    export.add_argument("name", choices=["minilm"], help="which model")
    export.add_argument("out", type=Path, metavar="OUT.onnx")
    export.add_argument(
        "--pooled", action="store_true", help="also output the normalised sentence embedding"
    )
    export.set_defaults(run=run_export)


def _parse_dims(items: list[str]) -> dict[str, int]:
    dims: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--dim wants NAME=POSITIVE_INT, got {item!r}")
        dims[name] = int(value)
    return dims


def run_split(args: argparse.Namespace) -> int:
    """Handler of ``fedshard split``."""
    from rich.console import Console

    from partitioner.errors import GraphError, InfeasiblePlanError, VerificationError
    from partitioner.split import SplitOptions, split_model
    from protocols.devices import DeviceList
    from protocols.errors import SchemaError
    from protocols.plan import Objective

    console = Console()
    try:
        dims = _parse_dims(args.dim)
        devices = DeviceList.from_json(args.devices.read_bytes())
    except (OSError, ValueError, SchemaError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return EXIT_BAD_INPUT
    options = SplitOptions(
        objective=Objective(args.objective),
        queue_depth=args.queue_depth,
        verify=args.verify,
        tolerance=args.tolerance,
        dims=dims,
        samples_path=args.inputs,
        max_units=args.max_units,
        carry_io=not args.direct_io,
    )
    try:
        result = split_model(args.model, devices, args.out, options)
    except InfeasiblePlanError as exc:
        console.print(
            f"[red]infeasible:[/] {exc}\n"
            f"The best arrangement falls short by {exc.shortfall_bytes} bytes "
            f"({_mib(exc.shortfall_bytes)}); add a device or memory."
        )
        return EXIT_INFEASIBLE
    except VerificationError as exc:
        console.print(f"[red]verification failed:[/] max abs diff {exc.max_abs_diff:.3g}: {exc}")
        return EXIT_VERIFY_FAILED
    except (GraphError, SchemaError, OSError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return EXIT_BAD_INPUT
    _print_split(console, result, devices)
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _print_split(console: Any, result: Any, devices: Any) -> None:
    from rich.table import Table

    memory = {d.name: d.memory_bytes for d in devices.devices}
    plan, manifest, analysis = result.plan, result.manifest, result.analysis
    console.print(
        f"[bold]{manifest.model.name}[/]: {len(analysis.index.nodes)} nodes, "
        f"{len(analysis.units.units)} units, {_mib(manifest.model.param_bytes)} of weights; "
        f"samples {analysis.samples_source}, dims {dict(analysis.table.dims)}"
    )
    table = Table(title=f"plan ({plan.objective.value})")
    for col in ("seg", "device", "units", "params", "pred. memory", "device memory", "compute"):
        table.add_column(col, justify="right" if col not in ("device",) else "left")
    table.add_column("hands off")
    for seg in manifest.segments:
        table.add_row(
            str(seg.index),
            seg.device,
            f"[{seg.units[0]}, {seg.units[1]})",
            _mib(seg.param_bytes),
            _mib(seg.predicted_memory_bytes),
            _mib(memory[seg.device]),
            f"{seg.predicted_compute_s * 1e3:.2f} ms",
            f"{len(seg.outputs)} tensors",
        )
    console.print(table)
    console.print(
        f"bottleneck {plan.bottleneck_s * 1e3:.3f} ms, latency {plan.latency_s * 1e3:.3f} ms; "
        f"wrote {len(manifest.segments)} segments to {result.segments[0].files[0].parent}"
    )
    if result.verification is not None:
        v = result.verification
        console.print(
            f"[green]verified:[/] max abs diff {v.max_abs_diff:.3g} (tolerance {v.tolerance:.3g})"
        )


def run_export(args: argparse.Namespace) -> int:
    """Handler of ``fedshard export``."""
    from rich.console import Console

    from partitioner.errors import GraphError
    from partitioner.frontdoor import FRONT_DOORS

    console = Console()
    try:
        result = FRONT_DOORS[args.name](args.out, pooled=args.pooled)
    except (GraphError, OSError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return EXIT_BAD_INPUT
    console.print(
        f"wrote {result.path} ({_mib(result.param_bytes)} of weights, outputs "
        f"{', '.join(result.outputs)}); ONNX Runtime vs PyTorch max abs diff "
        f"{result.max_abs_diff:.3g}"
    )
    return 0
