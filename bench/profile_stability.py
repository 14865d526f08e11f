"""Run-to-run stability of ``fedshard profile``: both roofs, repeated in one run.

Target (issues 3 and 18): each roof stable to about +-10% from run to run. Prints each
measurement and, per roof, the largest deviation from the median
(:func:`edge_agent.profile.membench.run_spread`).

    .venv/bin/python bench/profile_stability.py [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from report.headlines import Headline, write_headlines
from rich.console import Console
from rich.table import Table

from edge_agent.config import RuntimeConfig
from edge_agent.profile.membench import run_spread
from edge_agent.profile.microbench import measure_profile

RESULTS = Path(__file__).parent / "results" / "profile_stability.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    profiles = [measure_profile(RuntimeConfig()) for _ in range(args.repeat)]
    gflops = [p.gflops for p in profiles]
    gbps = [p.memory_gbps or 0.0 for p in profiles]
    table = Table(title=f"fedshard profile, {args.repeat} runs ({os.cpu_count()} cores)")
    for column in ("run", "GFLOP/s", "memory GB/s", "cache", "cache GB/s", "op us"):
        table.add_column(column, justify="right")
    rows = []
    for i, p in enumerate(profiles):
        row = (
            str(i + 1),
            f"{p.gflops:.2f}",
            f"{p.memory_gbps or 0:.2f}",
            f"{(p.cache_bytes or 0) >> 20} MiB",
            f"{p.cache_gbps or 0:.2f}",
            f"{p.op_us or 0:.2f}",
        )
        rows.append(row)
        table.add_row(*row)
    console = Console()
    console.print(table)
    summary = []
    for name, values, unit in (("compute", gflops, "GFLOP/s"), ("memory", gbps, "GB/s")):
        worst = run_spread(values)
        verdict = "met" if worst <= 0.10 else "MISSED"
        summary.append(
            f"{name} roof: median {statistics.median(values):.2f} {unit}, largest deviation "
            f"from the median {worst:.1%} (target +-10%: {verdict})"
        )
    for line in summary:
        console.print(line)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    lines = "\n".join(f"| {' | '.join(r)} |" for r in rows)
    RESULTS.write_text(
        "# Profile stability\n\n| run | GFLOP/s | memory GB/s | cache | cache GB/s | op us |\n"
        f"|---|---|---|---|---|---|\n{lines}\n\n" + "\n\n".join(summary) + "\n"
    )
    write_headlines(
        "profile_stability",
        [
            Headline(
                "`fedshard profile` largest deviation from the median",
                run_spread(gflops) * 100,
                "%",
                "<= 10",
            ),
            Headline("`fedshard profile` median", statistics.median(gflops), "GFLOP/s"),
            Headline(
                "memory roof largest deviation from the median",
                run_spread(gbps) * 100,
                "%",
                "<= 10",
            ),
            Headline("memory roof median", statistics.median(gbps), "GB/s"),
        ],
    )


if __name__ == "__main__":
    main()
