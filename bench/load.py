"""Sustained load: one-sentence embeddings from concurrent clients through the coordinator.

A real ``fedshard coordinator`` and three agents on 127.0.0.1 serve all-MiniLM-L6-v2 cut in
three (the same lab as ``tests/e2e/test_load.py``). Sixteen threads, each with a keep-alive
HTTP client, send ``/v1/embeddings`` requests until 10,000 are answered. Reported: throughput,
latency percentiles (p50, p99, max, measured by the clients from send to answer), errors, and
the resident memory of each process after the first 1,000 answers and after the last.

    .venv/bin/python bench/load.py [--requests 10000] [--clients 16]

Prints a table and writes bench/results/load.md and load.json. Targets: no error; resident
memory grows by less than 5 % from the first thousand requests to the last.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from agent_helpers import minilm_model  # noqa: E402
from load_lab import LoadResult, minilm_lab, run_load  # noqa: E402
from report.headlines import Headline, write_headlines  # noqa: E402
from report.machine import stamp  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

CACHE = REPO / ".pytest_cache" / "d" / "fedshard-minilm"
RESULTS = REPO / "bench" / "results"
MAX_GROWTH = 0.05


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--sample-every", type=int, default=1_000)
    args = parser.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    model = minilm_model(CACHE)
    with tempfile.TemporaryDirectory() as tmp, minilm_lab(Path(tmp), model) as lab:
        run_load(lab, 200, args.clients, sample_every=10**9)  # warm every connection first
        result = run_load(lab, args.requests, args.clients, args.sample_every)
    report(result, args)
    return 0 if not result.errors else 1


def rows(result: LoadResult, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """The table: measure, value, note."""
    table = [
        ("requests answered", f"{len(result.latencies_s)}", f"{args.clients} concurrent clients"),
        ("errors", f"{len(result.errors)}", "target 0"),
        ("wall time", f"{result.seconds:.1f} s", ""),
        ("throughput", f"{result.throughput:.1f} req/s", ""),
        ("latency p50", f"{result.percentile_ms(50):.1f} ms", "send to answer, per client"),
        ("latency p99", f"{result.percentile_ms(99):.1f} ms", ""),
        ("latency max", f"{result.percentile_ms(100):.1f} ms", ""),
    ]
    for name, samples in result.memory.items():
        table.append(
            (
                f"RSS growth, {name}",
                f"{result.growth(name):+.2%}",
                f"{samples[0] / 2**20:.1f} MiB after {args.sample_every} requests, "
                f"{samples[-1] / 2**20:.1f} MiB after the last; target < +5%",
            )
        )
    return table


def report(result: LoadResult, args: argparse.Namespace) -> None:
    """Print the table; write load.md and load.json."""
    lines = rows(result, args)
    table = Table(title=f"fedshard load: {args.requests} one-sentence embeddings, MiniLM, 3 agents")
    for col in ("measure", "value", "note"):
        table.add_column(col)
    for line in lines:
        table.add_row(*line)
    worst = max(result.growth(name) for name in result.memory)
    verdict = (
        f"errors target {'met' if not result.errors else 'NOT met'}; memory target "
        f"{'met' if worst < MAX_GROWTH else 'NOT met'} (largest growth {worst:+.2%}); "
        f"{os.cpu_count()} cores for the coordinator, 3 agents and the clients"
    )
    Console().print(table)
    Console().print(verdict)
    text = [
        "# Load: 10,000 embeddings through the coordinator",
        "",
        "`.venv/bin/python bench/load.py` — a `fedshard coordinator` and three agents on "
        "127.0.0.1 serving all-MiniLM-L6-v2 cut in three (TLS between agents), "
        f"{args.clients} client threads with keep-alive HTTP clients sending one-sentence "
        f"`/v1/embeddings` requests until {args.requests} are answered (after 200 warm-up "
        "requests). Latency is measured by each client from send to answer. Resident memory "
        f"of every process (psutil) is sampled after every {args.sample_every} answers.",
        "",
        *stamp(REPO),
        "",
        "| measure | value | note |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in lines],
        "",
        verdict,
        "",
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "load.md").write_text("\n".join(text))
    headlines = [
        Headline("load errors, 10,000 embeddings at 16 clients", len(result.errors), "", "<= 0"),
        Headline("load throughput, MiniLM one sentence", result.throughput, "req/s"),
        Headline("load latency p50", result.percentile_ms(50), "ms"),
        Headline("load latency p99", result.percentile_ms(99), "ms"),
        Headline("load latency max", result.percentile_ms(100), "ms"),
        Headline("largest RSS growth, first 1,000 to last", worst * 100, "%", "< 5"),
    ]
    write_headlines("load", headlines)


if __name__ == "__main__":
    sys.exit(main())
