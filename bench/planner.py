"""Planner benchmark: the exact optimum against exo's and an even split, and planning time at scale.

For each of the 24 PipeEdge problems in ``../shared/benchmarks/planner/`` it prints the optimal
bottleneck (throughput objective) and the optimal latency (latency objective) next to what exo's
memory-weighted split and an even split give under the same exact semantics, with ratios
(baseline / optimum; a baseline that overflows a device's memory is marked), plus planning time.
Then it plans the synthetic cases: 16 devices x 200 units, the 100B decoder, 16 distinct devices.

Run: ``.venv/bin/python bench/planner.py [--skip-worst-case]``. Results also go to
``bench/results/planner.md`` and ``bench/results/planner.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from report.headlines import Headline, write_headlines
from rich.console import Console
from rich.table import Table

from partitioner.planning import synthetic
from partitioner.planning.baselines import Baseline, BaselineResult, run_baseline
from partitioner.planning.fleet import build_fleet
from partitioner.planning.planner import plan
from protocols.plan import Objective, Plan
from protocols.problem import PlanningProblem

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "benchmarks" / "planner"
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Comparison:
    """One problem: both optima, both baselines, and how long planning took."""

    name: str
    throughput: Plan
    latency: Plan
    baselines: dict[Baseline, BaselineResult]
    seconds: dict[Objective, float]


def timed(run: Callable[[], Plan], repeats: int) -> tuple[Plan, float]:
    """The result of ``run`` and its best wall time over ``repeats`` runs."""
    start = time.perf_counter()
    result = run()
    best = time.perf_counter() - start
    for _ in range(repeats - 1):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return result, best


def compare(name: str, problem: PlanningProblem, repeats: int) -> Comparison:
    """Plan ``problem`` for both objectives and score both baselines."""
    plans: dict[Objective, Plan] = {}
    seconds: dict[Objective, float] = {}
    for objective in Objective:
        plans[objective], seconds[objective] = timed(partial(plan, problem, objective), repeats)
    baselines = {b: run_baseline(problem, Objective.THROUGHPUT, b) for b in Baseline}
    return Comparison(
        name, plans[Objective.THROUGHPUT], plans[Objective.LATENCY], baselines, seconds
    )


def ratio(value: float, best: float, fits: bool) -> str:
    """``value / best`` as ``×1.23``; ``✗mem`` marks a split that overflows a device's memory."""
    text = f"×{value / best:.2f}" if best > 0 else f"{value:.4g}"
    return text if fits else f"{text} ✗mem"


def comparison_rows(rows: list[Comparison]) -> tuple[list[str], list[list[str]]]:
    """Headers and cells shared by the terminal and the Markdown tables."""
    headers = [
        "problem",
        "bottleneck s",
        "exo",
        "even",
        "latency s",
        "exo",
        "even",
        "plan ms thr",
        "plan ms lat",
    ]
    cells = []
    for row in rows:
        exo, even = row.baselines[Baseline.EXO], row.baselines[Baseline.EVEN]
        best_b, best_l = row.throughput.bottleneck_s, row.latency.latency_s
        cells.append(
            [
                row.name,
                f"{best_b:.4f}",
                ratio(exo.plan.bottleneck_s, best_b, exo.fits),
                ratio(even.plan.bottleneck_s, best_b, even.fits),
                f"{best_l:.4f}",
                ratio(exo.plan.latency_s, best_l, exo.fits),
                ratio(even.plan.latency_s, best_l, even.fits),
                f"{row.seconds[Objective.THROUGHPUT] * 1e3:.1f}",
                f"{row.seconds[Objective.LATENCY] * 1e3:.1f}",
            ]
        )
    return headers, cells


def synthetic_cases(worst_case: bool) -> list[tuple[str, PlanningProblem]]:
    """The scale cases, each a ``(label, problem)``."""
    mid, big = synthetic.MID_20B, synthetic.LLAMA_100B
    cases = [
        ("home lab, 16 devices of 7 kinds", synthetic.decoder_problem(mid, synthetic.HOME_LAB_16)),
        (
            "100B decoder, 16 devices of 4 kinds",
            synthetic.decoder_problem(big, synthetic.CLUSTER_100B),
        ),
        (
            "16 distinct devices, one LAN",
            synthetic.decoder_problem(mid, synthetic.distinct_kinds(16, True)),
        ),
    ]
    if worst_case:
        worst = synthetic.decoder_problem(mid, synthetic.distinct_kinds(16))
        cases.append(("16 distinct devices and links", worst))
    return cases


def scale_rows(
    cases: list[tuple[str, PlanningProblem]], console: Console
) -> tuple[list[str], list[list[str]]]:
    """Plan every synthetic case once per objective and describe it."""
    headers = [
        "case",
        "devices",
        "units",
        "classes",
        "states",
        "objective",
        "bottleneck s",
        "latency s",
        "stages",
        "exo bottleneck",
        "even bottleneck",
        "plan s",
    ]
    cells = []
    for label, problem in cases:
        fleet = build_fleet(problem)
        baselines = {b: run_baseline(problem, Objective.THROUGHPUT, b) for b in Baseline}
        for objective in Objective:
            console.log(f"planning {label} for {objective.value}")
            result, seconds = timed(partial(plan, problem, objective), 1)
            against = [
                ratio(baselines[b].plan.bottleneck_s, result.bottleneck_s, baselines[b].fits)
                if objective is Objective.THROUGHPUT
                else ""
                for b in Baseline
            ]
            cells.append(
                [
                    label,
                    str(len(problem.devices)),
                    str(len(problem.units)),
                    str(len(fleet.classes)),
                    str(fleet.n_states),
                    objective.value,
                    f"{result.bottleneck_s:.4f}",
                    f"{result.latency_s:.4f}",
                    str(len(result.stages)),
                    *against,
                    f"{seconds:.3f}",
                ]
            )
    return headers, cells


def rich_table(title: str, headers: list[str], cells: list[list[str]]) -> Table:
    """A terminal table."""
    table = Table(title=title)
    for index, header in enumerate(headers):
        table.add_column(header, justify="left" if index == 0 else "right")
    for row in cells:
        table.add_row(*row)
    return table


def markdown_table(headers: list[str], cells: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def plot(rows: list[Comparison], path: Path) -> bool:
    """Bar chart of baseline / optimum bottleneck ratios; ``False`` if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axis = plt.subplots(figsize=(12, 4.5))
    width = 0.4
    for offset, baseline in ((-width / 2, Baseline.EXO), (width / 2, Baseline.EVEN)):
        values = [r.baselines[baseline].plan.bottleneck_s / r.throughput.bottleneck_s for r in rows]
        hatches = ["" if r.baselines[baseline].fits else "//" for r in rows]
        bars = axis.bar(
            [i + offset for i in range(len(rows))],
            values,
            width,
            label=f"{baseline.value} / optimum",
        )
        for bar, hatch in zip(bars, hatches, strict=True):
            bar.set_hatch(hatch)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(rows)), [r.name for r in rows], rotation=70, ha="right", fontsize=7)
    axis.set_ylabel("bottleneck, baseline / optimum")
    axis.set_title(
        "PipeEdge ViT problems: baselines against the exact optimum (hatched: overflows memory)"
    )
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def headlines(rows: list[Comparison], scale_cells: list[list[str]]) -> list[Headline]:
    """Baseline / optimum bottleneck on the PipeEdge problems (worst and geometric mean), the
    planning time of every synthetic case (throughput objective), exo's ratio on the home lab."""
    out = []
    for baseline in Baseline:
        ratios = [r.baselines[baseline].plan.bottleneck_s / r.throughput.bottleneck_s for r in rows]
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        what = f"{baseline.value} split / optimum, bottleneck, {len(rows)} PipeEdge problems"
        out += [
            Headline(f"{what}, worst", max(ratios), "x"),
            Headline(f"{what}, geomean", geo, "x"),
        ]
    for cells in scale_cells:
        if cells[5] != Objective.THROUGHPUT.value:
            continue
        case = f"{cells[0]}, {cells[2]} units"
        out.append(Headline(f"planning time, {case}", float(cells[-1]), "s"))
        if cells[0].startswith("home lab"):
            exo = cells[9].split()[0].lstrip("×")
            out.append(Headline(f"exo split / optimum, bottleneck, {case}", float(exo), "x"))
    return out


def main() -> int:
    """Run the benchmark, print it, and write the Markdown and PNG results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--skip-worst-case",
        action="store_true",
        help="skip 16 devices that are all distinct, links included (about 6 s, 1 GB)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timing repeats for the PipeEdge problems"
    )
    args = parser.parse_args()
    console = Console()
    if not console.is_terminal:
        console.width = 200
    files = sorted(SHARED.glob("*.json"))
    if not files:
        console.print(f"[red]no PipeEdge problems under {SHARED}[/red]")
        return 1
    rows = []
    for path in files:
        problem = PlanningProblem.from_json(path.read_text())
        rows.append(compare(path.stem.removeprefix("pipeedge-"), problem, args.repeats))
    headers, cells = comparison_rows(rows)
    console.print(rich_table("PipeEdge problems: exact optimum vs baselines", headers, cells))
    scale_headers, scale_cells = scale_rows(synthetic_cases(not args.skip_worst_case), console)
    console.print(rich_table("Synthetic scale", scale_headers, scale_cells))
    RESULTS.mkdir(parents=True, exist_ok=True)
    plotted = plot(rows, RESULTS / "planner.png")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report = "\n\n".join(
        [
            "# Planner benchmark",
            f"`{' '.join([Path(sys.executable).name, *sys.argv])}` on {platform.machine()}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}; peak RSS {peak:.0f} MiB. "
            "Ratios are baseline / optimum under the same exact `fedshard.problem/1` semantics; "
            "`✗mem` marks a split that overflows a device's memory (it could not run). "
            "Baselines are scored on the bottleneck (throughput) and on latency; the optimum for "
            "each column is the plan for that objective. Plan times are the best of "
            f"{args.repeats} runs.",
            "## PipeEdge problems (ViT-Base, ViT-Large; MinnowBoard and RCC-VE boards)",
            markdown_table(headers, cells),
            "![baseline / optimum bottleneck](planner.png)" if plotted else "",
            "## Synthetic scale (one run each)",
            markdown_table(scale_headers, scale_cells),
            "*classes*: groups of interchangeable devices (same type, memory and links); *states*: "
            "count vectors over them, the size of the dynamic programme. Devices that are all "
            "distinct are the worst case: 2^16 states, and with distinct bandwidths also 15 "
            "sender groups (the last stage's links must be tracked). There the least bottleneck "
            "is found by a search with a bit-set feasibility check "
            "(`partitioner/planning/reach.py`), then a min-plus pass breaks ties by latency.",
        ]
    )
    (RESULTS / "planner.md").write_text(report + "\n")
    write_headlines("planner", headlines(rows, scale_cells))
    console.print(f"wrote {RESULTS / 'planner.md'}" + (" and planner.png" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
