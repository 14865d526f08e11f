"""``fedshard plan``: plan a ``fedshard.problem/1`` document and print the plan.

By default the plan is the optimum, except that a plan on one device within
:data:`~partitioner.planning.planner.ONE_DEVICE_MARGIN` (5 %) of it is preferred (as ``fedshard
split`` and the coordinator deploy); the output then says so. ``--exact`` prints the optimum of
the stated problem.

Exit codes: 0 a plan was printed; 1 a ``--baseline`` plan was printed but overflows a device's
memory; 2 the problem file is unreadable or invalid, or no arrangement fits (the message says by
how many bytes the best arrangement falls short).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from partitioner.errors import InfeasiblePlanError
from partitioner.planning.baselines import Baseline, BaselineResult, run_baseline
from partitioner.planning.planner import (
    ONE_DEVICE_MARGIN,
    MarginChoice,
    PlanningInputError,
    choose_with_margin,
    plan,
)
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
            "so that every stage fits its device and the objective is optimal, except that a "
            f"plan on one device within {ONE_DEVICE_MARGIN:.0%} of the optimum is preferred "
            "(every hop between devices costs what the problem does not price; fedshard split "
            "and the coordinator choose the same way). The output says when that happened; "
            "--exact prints the optimum of the stated problem instead."
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
        "--exact",
        action="store_true",
        help=(  # argparse %-formats a help string: the margin's "%" is written "%%"
            "print the optimum of the stated problem, even when a plan on one device comes "
            f"within {ONE_DEVICE_MARGIN * 100:.0f}%% of it (default: that one-device plan is "
            "preferred)"
        ),
    )
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
        chosen = _choose(problem, objective, baseline, exact=args.exact)
    except (InfeasiblePlanError, PlanningInputError) as exc:
        errors.print(f"error: {exc}", markup=False)
        return EXIT_ERROR
    result, preferred = chosen.plan, chosen.margin is not None and chosen.margin.margin_applied
    out = errors  # with --json, stdout holds one JSON document and nothing else
    if args.json:
        sys.stdout.write(result.to_json() + "\n")
    else:
        out = Console(highlight=False)
        if not out.is_terminal:
            out.width = 120
        out.print(_table(problem, result, baseline, preferred))
    if chosen.margin is not None and preferred:
        out.print(_margin_message(chosen.margin), markup=False, soft_wrap=True)  # one line
    if chosen.scored is not None and chosen.scored.overflows:
        errors.print(_overflow_message(chosen.scored), markup=False)
        return EXIT_OVERFLOW
    return EXIT_OK


@dataclass(frozen=True)
class _Chosen:
    plan: Plan
    margin: MarginChoice | None = None
    """The default choice and the optimum it weighed (not with ``--exact`` or a baseline)."""
    scored: BaselineResult | None = None


def _choose(
    problem: PlanningProblem, objective: Objective, baseline: Baseline | None, *, exact: bool
) -> _Chosen:
    if baseline is not None:
        scored = run_baseline(problem, objective, baseline)
        return _Chosen(scored.plan, scored=scored)
    if exact:
        return _Chosen(plan(problem, objective))
    margin = choose_with_margin(problem, objective)
    return _Chosen(margin.chosen, margin=margin)


def _overflow_message(scored: BaselineResult) -> str:
    parts = ", ".join(f"{device} by {format_bytes(over)}" for device, over in scored.overflows)
    return f"warning: the {scored.baseline.value} baseline does not fit: it overflows {parts}"


def _margin_message(choice: MarginChoice) -> str:
    optimum, chosen = choice.optimum, choice.chosen
    latency = chosen.objective is Objective.LATENCY
    what = "latency" if latency else "bottleneck"
    ours = chosen.latency_s if latency else chosen.bottleneck_s
    best = optimum.latency_s if latency else optimum.bottleneck_s
    return (
        f"note: one device ({chosen.stages[0].device}) preferred: {what} {ours:.4g} s, within "
        f"{ONE_DEVICE_MARGIN:.0%} of the optimum's {best:.4g} s on {len(optimum.stages)} "
        "devices; --exact prints the optimum"
    )


def _table(
    problem: PlanningProblem, result: Plan, baseline: Baseline | None, preferred: bool = False
) -> Table:
    devices = {device.name: device for device in problem.devices}
    objective = result.objective.value
    how = f"{baseline.value} baseline" if baseline else f"optimal for {objective}"
    if preferred:
        how = f"one device, within {ONE_DEVICE_MARGIN:.0%} of optimal for {objective}"
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
