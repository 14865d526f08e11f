"""``fedshard plan``: plan a ``fedshard.problem/1`` document and print the plan.

Exit codes: 0 a plan was printed; 1 a ``--baseline`` plan was printed but overflows a device's
memory; 2 the problem file is unreadable or invalid, or no arrangement fits (the message says by
how many bytes the best arrangement falls short).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from partitioner.errors import InfeasiblePlanError
from partitioner.planning.baselines import Baseline, BaselineResult, run_baseline
from partitioner.planning.planner import PlanningInputError, plan_preferring_one_device
from partitioner.planning.semantics import format_bytes
from protocols.errors import SchemaError
from protocols.plan import Objective, Plan
from protocols.problem import PlanningProblem

EXIT_OK = 0
EXIT_OVERFLOW = 1
EXIT_ERROR = 2


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``plan`` subcommand and bind its handler with ``set_defaults(run=...)``."""
    parser = subparsers.add_parser(
        "plan",
        help="plan a fedshard.problem/1 document: devices, order and cuts",
        description=(
            "Choose which devices to use, in which order, and where to cut the chain of units "
            "so that every stage fits its device and the objective is optimal."
        ),
    )
    parser.add_argument(
        "--problem", required=True, type=Path, metavar="PROBLEM.json", help="the planning problem"
    )
    parser.add_argument(
        "--objective",
        choices=[objective.value for objective in Objective],
        default=Objective.THROUGHPUT.value,
        help="throughput: least bottleneck stage (default); latency: least end-to-end time",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--baseline",
        choices=[baseline.value for baseline in Baseline],
        help="instead of planning, score a baseline split: exo (memory-weighted) or even",
    )
    parser.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """Handle ``fedshard plan``; returns the exit code."""
    errors = Console(stderr=True, highlight=False, soft_wrap=True)  # whole lines: grep-able
    try:
        problem = PlanningProblem.from_json(Path(args.problem).read_bytes())
    except OSError as exc:
        errors.print(f"error: cannot read {args.problem}: {exc.strerror or exc}", markup=False)
        return EXIT_ERROR
    except SchemaError as exc:
        errors.print(f"error: {args.problem}: {exc}", markup=False)
        return EXIT_ERROR
    objective = Objective(args.objective)
    baseline = Baseline(args.baseline) if args.baseline else None
    try:
        if baseline is None:
            result = plan_preferring_one_device(problem, objective)
            overflows: list[tuple[str, int]] = []
        else:
            scored = run_baseline(problem, objective, baseline)
            result, overflows = scored.plan, scored.overflows
    except (InfeasiblePlanError, PlanningInputError) as exc:
        errors.print(f"error: {exc}", markup=False)
        return EXIT_ERROR
    if args.json:
        sys.stdout.write(result.to_json() + "\n")
    else:
        console = Console(highlight=False)
        if not console.is_terminal:
            console.width = 120
        console.print(_table(problem, result, baseline))
    if overflows:
        errors.print(_overflow_message(scored), markup=False)
        return EXIT_OVERFLOW
    return EXIT_OK


def _overflow_message(scored: BaselineResult) -> str:
    parts = ", ".join(f"{device} by {format_bytes(over)}" for device, over in scored.overflows)
    return f"warning: the {scored.baseline.value} baseline does not fit: it overflows {parts}"


def _table(problem: PlanningProblem, result: Plan, baseline: Baseline | None) -> Table:
    devices = {device.name: device for device in problem.devices}
    how = f"{baseline.value} baseline" if baseline else f"optimal for {result.objective.value}"
    title = f"{problem.name or 'plan'} — {how}"
    used = len(result.stages)
    rate = f"{1 / result.bottleneck_s:.3g}/s" if result.bottleneck_s > 0 else "unbounded"
    caption = (
        f"bottleneck {result.bottleneck_s:.4g} s ({rate} micro-batches), "
        f"latency {result.latency_s:.4g} s, {used} of {len(devices)} devices"
    )
    requester = problem.requester is not None
    if requester:
        caption += (
            f"; requester: input {result.input_transfer_s:.4g} s in, "
            f"result {result.stages[-1].transfer_s:.4g} s back (the last send)"
        )
    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD)
    for header in ("#", "device", "type", "units", "first … last"):
        table.add_column(header, no_wrap=header != "first … last")
    for header in ("compute s", "send s", "memory", "of device"):
        table.add_column(header, justify="right", no_wrap=True)
    for index, stage in enumerate(result.stages):
        device = devices[stage.device]
        first, last = problem.units[stage.start].name, problem.units[stage.end - 1].name
        over = stage.memory_bytes > device.memory_bytes
        share = stage.memory_bytes / device.memory_bytes if device.memory_bytes else float("inf")
        table.add_row(
            str(index),
            stage.device,
            device.type,
            f"[{stage.start}, {stage.end})",
            first if first == last else f"{first} … {last}",
            f"{stage.compute_s:.4g}",
            f"{stage.transfer_s:.4g}" if index + 1 < used or requester else "—",
            format_bytes(stage.memory_bytes),
            f"{share:.0%}" + (" OVER" if over else ""),
            style="red" if over else None,
        )
    return table
