"""Run-to-run stability of ``fedshard profile``'s GFLOP/s micro-benchmark.

Target (issue 3): stable to about ±10% from run to run. Prints each measurement and the
spread (max / min) of the same benchmark repeated in one run.

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
from edge_agent.microbench import measure_gflops

RESULTS = Path(__file__).parent / "results" / "profile_stability.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    values = [measure_gflops(RuntimeConfig()).gflops for _ in range(args.repeat)]
    spread = max(values) / min(values)
    median = statistics.median(values)
    worst = max(abs(v - median) / median for v in values)
    table = Table(title=f"fedshard profile, {args.repeat} runs ({os.cpu_count()} cores)")
    for column in ("run", "GFLOP/s"):
        table.add_column(column, justify="right")
    for i, value in enumerate(values):
        table.add_row(str(i + 1), f"{value:.2f}")
    console = Console()
    console.print(table)
    verdict = "met" if worst <= 0.10 else "MISSED"
    summary = (
        f"median {median:.2f} GFLOP/s, max/min {spread:.3f}, "
        f"largest deviation from the median {worst:.1%} (target ±10%: {verdict})"
    )
    console.print(summary)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    rows = "\n".join(f"| {i + 1} | {v:.2f} |" for i, v in enumerate(values))
    RESULTS.write_text(
        f"# Profile stability\n\n| run | GFLOP/s |\n|---|---|\n{rows}\n\n{summary}\n"
    )
    write_headlines(
        "profile_stability",
        [
            Headline(
                "`fedshard profile` largest deviation from the median", worst * 100, "%", "<= 10"
            ),
            Headline("`fedshard profile` median", median, "GFLOP/s"),
        ],
    )


if __name__ == "__main__":
    main()
