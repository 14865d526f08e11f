"""``fedshard split`` and ``fedshard export``: the partitioner's file-level commands.

Importing this module is cheap: onnx, onnxruntime and torch are imported inside the handlers.

Exit codes of ``split``: 0 done, 1 bad input (model, devices, samples), 3 no arrangement of the
devices holds the model, 4 ``--verify`` found the chain differs from the whole model.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from partitioner.cli.cli_args import EXIT_BAD_INPUT, human_size, positive_int
from partitioner.cli.export_cli import register_export
from partitioner.errors import InfeasiblePlanError, PartitionerError, VerificationError
from protocols.constants import DEFAULT_QUEUE_DEPTH
from protocols.manifest import DEFAULT_SESSIONS

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
    split.add_argument("model", type=Path, metavar="MODEL.onnx", help="the model to cut")
    split.add_argument(
        "--devices", type=Path, required=True, metavar="DEVICES.json", help="devices and links"
    )
    split.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="where segments and manifest go"
    )
    split.add_argument(
        "--objective",
        choices=["throughput", "latency"],
        default="throughput",
        help="minimise the bottleneck stage (default) or end-to-end time",
    )
    split.add_argument(
        "--queue-depth",
        type=int,
        default=DEFAULT_QUEUE_DEPTH,
        metavar="N",
        help=f"frames buffered per stage queue ({DEFAULT_QUEUE_DEPTH}, as the agents do)",
    )
    split.add_argument(
        "--verify", action="store_true", help="run the chain in ONNX Runtime and compare"
    )
    split.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="max abs diff for --verify (default 1e-5, 5e-2 for float16 models)",
    )
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
    split.add_argument(
        "--max-units", type=int, default=128, metavar="N", help="most planning units (128)"
    )
    split.add_argument(
        "--direct-io",
        action="store_true",
        help="feed model inputs straight to the segments using them (no pass-through)",
    )
    split.add_argument(
        "--sessions",
        type=positive_int,
        default=DEFAULT_SESSIONS.max_sessions,
        metavar="N",
        help="decoders: concurrent generation sessions every stage reserves KV cache for (4)",
    )
    split.add_argument(
        "--context",
        type=positive_int,
        default=DEFAULT_SESSIONS.max_context,
        metavar="TOKENS",
        help="decoders: tokens per session (prompt plus generated) the KV cache holds (1024)",
    )
    split.add_argument(
        "--calibrate",
        action="store_true",
        help="time every unit in ONNX Runtime here and plan with the measured compute shares",
    )
    split.add_argument(
        "--calibration-runs",
        type=positive_int,
        default=10,
        metavar="N",
        help="timed runs per unit for --calibrate; the fastest counts (10)",
    )
    split.add_argument(
        "--calibration-threads",
        type=positive_int,
        default=1,
        metavar="N",
        help="ONNX Runtime intra-op threads for --calibrate (1, like the edge agent)",
    )
    split.add_argument(
        "--runtime-overhead",
        type=_size_arg,
        default=None,
        metavar="BYTES",
        help=(
            "fixed resident memory of one ONNX Runtime session on an agent, added to every "
            "segment's predicted memory (default 1.5MiB, measured; accepts KiB/MiB/GiB)"
        ),
    )
    split.add_argument(
        "--workspace-factor",
        type=float,
        default=None,
        metavar="F",
        help=(
            "arena bytes the runtime holds per byte of the graph's activation live set "
            "(default 3.5, measured)"
        ),
    )
    split.set_defaults(run=run_split)

    register_export(subparsers)


_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def _size_arg(text: str) -> int:
    """``4096``, ``1.5MiB``, ``2GiB`` -> bytes (binary units only, so nothing is ambiguous)."""
    number = text.rstrip("KMGiBkmgb")
    unit = text[len(number) :].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or value < 0:
        raise argparse.ArgumentTypeError(f"wants a size like 4096 or 1.5MiB, got {text!r}")
    return int(value * _SIZE_UNITS[unit])


def _runtime_model(args: argparse.Namespace) -> Any:
    # heavy: keeps onnx off a light import
    from partitioner.analysis.runtime_memory import RuntimeMemory

    model = RuntimeMemory()
    if args.runtime_overhead is not None:
        model = dataclasses.replace(model, overhead_bytes=args.runtime_overhead)
    if args.workspace_factor is not None:
        if args.workspace_factor < 0:
            raise ValueError("--workspace-factor must be non-negative")
        model = dataclasses.replace(model, workspace_factor=args.workspace_factor)
    return model


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

    # heavy: keeps onnx off a light import
    from partitioner.cutting.inputs import SplitOptions

    # heavy: keeps onnx off a light import
    from partitioner.cutting.split import split_model
    from protocols.devices import DeviceList
    from protocols.errors import SchemaError
    from protocols.manifest import SessionLimits
    from protocols.plan import Objective

    console = Console()
    try:
        dims = _parse_dims(args.dim)
        runtime = _runtime_model(args)
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
        carry_io=False if args.direct_io else None,
        sessions=SessionLimits(max_sessions=args.sessions, max_context=args.context),
        calibrate=args.calibrate,
        calibration_runs=args.calibration_runs,
        calibration_threads=args.calibration_threads,
        runtime=runtime,
    )
    try:
        result = split_model(args.model, devices, args.out, options)
    except InfeasiblePlanError as exc:
        message = f"[red]infeasible:[/] {exc}"
        if str(exc.shortfall_bytes) not in str(exc):
            message += f" (the best arrangement falls short by {exc.shortfall_bytes} bytes)"
        console.print(message)
        return EXIT_INFEASIBLE
    except VerificationError as exc:
        console.print(f"[red]verification failed:[/] max abs diff {exc.max_abs_diff:.3g}: {exc}")
        return EXIT_VERIFY_FAILED
    except (PartitionerError, SchemaError, OSError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return EXIT_BAD_INPUT
    print_split(console, result, devices)
    return 0


def print_split(console: Any, result: Any, devices: Any) -> None:
    """Print a split result: model summary, the plan table and the verification."""
    from rich.table import Table

    budget = {d.name: d.memory_bytes for d in devices.devices}
    plan, manifest, analysis = result.plan, result.manifest, result.analysis
    console.print(
        f"[bold]{manifest.model.name}[/]: {len(analysis.index.nodes)} nodes, "
        f"{len(analysis.units.units)} units, {human_size(manifest.model.param_bytes)} of weights; "
        f"samples {analysis.samples_source}, dims {dict(analysis.table.dims)}"
    )
    if analysis.table.estimated:
        console.print(
            f"[yellow]note:[/] {len(analysis.table.estimated)} tensor sizes are estimates "
            "(data-dependent shapes or operators without an ONNX schema)"
        )
    table = Table(title=f"plan ({plan.objective.value})")
    table.add_column("seg", justify="right", no_wrap=True)
    table.add_column("device")
    for column in ("units", "params", "memory", "budget", "compute", "hand-off"):
        table.add_column(column, justify="right", no_wrap=True)
    last = len(manifest.segments) - 1
    for seg in manifest.segments:
        out_bytes = result.problem.units[seg.units[1] - 1].out_bytes
        table.add_row(
            str(seg.index),
            seg.device,
            f"{seg.units[0]}-{seg.units[1]}",
            human_size(seg.param_bytes),
            human_size(seg.predicted_memory_bytes),
            human_size(budget[seg.device]),
            f"{seg.predicted_compute_s * 1e3:.2f} ms",
            "outputs" if seg.index == last else f"{len(seg.outputs)}: {human_size(out_bytes)}",
        )
    if result.calibration is not None:
        print_calibration(console, result.calibration)
    console.print(table)
    console.print(
        f"bottleneck {plan.bottleneck_s * 1e3:.3f} ms, latency {plan.latency_s * 1e3:.3f} ms"
        f"{_requester_note(result)}; wrote {len(manifest.segments)} segments and manifest.json to "
        f"{result.segments[0].files[0].parent}"
    )
    if result.calibration is not None:
        console.print(_calibration_note(result))
    if result.verification is not None:
        v = result.verification
        console.print(
            f"[green]verified:[/] max abs diff {v.max_abs_diff:.3g} (tolerance {v.tolerance:.3g})"
        )


def _requester_note(result: Any) -> str:
    """The transfers to and from the requester, when the plan counts them."""
    if result.problem.requester is None:
        return ""
    sent_in, back = result.plan.input_transfer_s, result.plan.stages[-1].transfer_s
    return f" (input in {sent_in * 1e3:.3f} ms, result back {back * 1e3:.3f} ms)"


def print_calibration(console: Any, calibration: Any) -> None:
    """Print each unit's share of the FLOPs next to its measured share of the time."""
    from rich.table import Table

    table = Table(
        title=(
            f"calibration: fastest of {calibration.runs} runs per unit, "
            f"{calibration.threads} thread(s)"
        )
    )
    table.add_column("unit", justify="right", no_wrap=True)
    table.add_column("name")
    for column in ("FLOP share", "measured share", "fastest", "median"):
        table.add_column(column, justify="right", no_wrap=True)
    rows = zip(
        calibration.names,
        calibration.flop_shares,
        calibration.shares,
        calibration.seconds,
        calibration.median_seconds,
        strict=True,
    )
    for k, (name, flop_share, share, fastest, median) in enumerate(rows):
        table.add_row(
            str(k),
            name,
            f"{flop_share:.1%}",
            f"{share:.1%}",
            f"{fastest * 1e3:.3f} ms",
            f"{median * 1e3:.3f} ms",
        )
    console.print(table)


def _calibration_note(result: Any) -> str:
    c = result.calibration
    moved = result.flop_plan is not None and _layout(result.flop_plan) != _layout(result.plan)
    return (
        f"compute calibrated on this machine ({c.total_s * 1e3:.2f} ms for the unit chain): "
        "predicted compute is each device's GFLOP/s applied to the measured shares; "
        + ("the plan differs from the FLOP-only one" if moved else "same plan as FLOPs alone give")
    )


def _layout(plan: Any) -> list[tuple[str, int, int]]:
    return [(s.device, s.start, s.end) for s in plan.stages]
