"""Assemble ``bench/results/REPORT.md`` from every benchmark's Markdown, JSON and PNG results."""

from __future__ import annotations

import datetime as dt
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from report.headlines import Headline, HeadlineError, read_headlines
from report.machine import stamp

REPORT = "REPORT.md"
ORDER = (
    "handoff",
    "frames",
    "pipeline",
    "generate",
    "peer_pipelining",
    "load",
    "planner",
    "federated",
    "profile_stability",
)
"""Sections in this order; results of any other benchmark follow alphabetically."""

COVERAGE = (
    ("Hand-off per hop against payload size: TLS data plane, plain TCP, numpy copy", "handoff"),
    ("Sharded against whole-model latency and throughput (MiniLM)", "pipeline"),
    ("Generation speed (Gemma 3 270M, 1 and 4 streams)", "generate"),
    ("Pipeline throughput against the measured slowest-stage bound", "pipeline"),
    ("Planner: optimal against exo-style and even splits, planning time at scale", "planner"),
    ("Planner on lab networks; predicted against measured stage times in the lab", "planner_lab"),
    ("Federated: centralized, FedAvg, SecAgg+, SecAgg+ with DP", "federated"),
    ("Peer engine on the same split: torch.distributed.pipelining", "peer_pipelining"),
)
"""Issue 9's list, each item with the result that answers it."""


@dataclass
class BenchResult:
    """One benchmark's results files."""

    name: str
    markdown: str
    headlines: list[Headline] = field(default_factory=list)
    headline_error: str = ""
    plots: list[str] = field(default_factory=list)
    written: str = ""

    @property
    def title(self) -> str:
        """The Markdown's first heading, else the benchmark's name."""
        for line in self.markdown.splitlines():
            if line.startswith("# "):
                return line[2:].strip()
        return self.name


def load(results: Path) -> list[BenchResult]:
    """Every ``<name>.md`` in ``results`` (but the report) with its JSON and plots, in order."""
    found = {p.stem: p for p in results.glob("*.md") if p.name != REPORT}
    names = [n for n in ORDER if n in found] + sorted(set(found) - set(ORDER))
    pngs = sorted(p.name for p in results.glob("*.png"))
    out = []
    for name in names:
        md = found[name]
        result = BenchResult(name, md.read_text())
        result.written = dt.datetime.fromtimestamp(md.stat().st_mtime, dt.UTC).strftime(
            "%Y-%m-%d %H:%M UTC"
        )
        json_path = md.with_suffix(".json")
        if json_path.exists():
            try:
                result.headlines = read_headlines(json_path)
                for headline in result.headlines:
                    _ = headline.met  # a target that cannot be read fails here, not below
            except HeadlineError as exc:
                result.headlines = []
                result.headline_error = str(exc)
        result.plots = [p for p in pngs if p == f"{name}.png" or p.startswith(f"{name}-")]
        out.append(result)
    return out


def _value(h: Headline) -> str:
    """The value with its unit: ratios to two decimals, other numbers to three digits."""
    if not math.isfinite(h.value):
        return "n/a"
    if h.unit == "x":
        return f"{h.value:.2f}x"
    if h.unit == "%":
        return f"{h.value:.1f}%"
    number = f"{h.value:.3g}" if abs(h.value) < 1000 else f"{h.value:,.0f}"
    return f"{number} {h.unit}".rstrip()


def _met(h: Headline) -> str:
    state = h.met
    return "" if state is None else ("met" if state else "**NOT met**")


def headline_table(results: list[BenchResult]) -> list[str]:
    """One row per headline of every benchmark; a benchmark without headlines says so."""
    lines = ["| benchmark | headline | value | target | |", "|---|---|---|---|---|"]
    for r in results:
        link = f"[{r.name}](#{anchor(r.title)})"
        if r.headline_error:
            lines.append(f"| {link} | unreadable headlines: {r.headline_error} | | | |")
        elif not r.headlines:
            lines.append(f"| {link} | no `{r.name}.json` yet: rerun `bench/{r.name}.py` | | | |")
        for h in r.headlines:
            lines.append(f"| {link} | {h.name} | {_value(h)} | {h.target or ''} | {_met(h)} |")
    return lines


def anchor(title: str) -> str:
    """GitHub's anchor for a heading."""
    slug = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return slug.replace(" ", "-")


def demote(markdown: str) -> list[str]:
    """The benchmark's Markdown one heading level down, its title dropped."""
    lines, fenced, dropped = [], False, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("# ") and not dropped:
            dropped = True
            continue
        elif not fenced and line.startswith("#"):
            line = "#" + line
        lines.append(line)
    return lines


def section(r: BenchResult) -> list[str]:
    """The benchmark's own results, with plots it does not already show."""
    body = demote(r.markdown)
    while body and not body[0].strip():
        body.pop(0)
    extra = [p for p in r.plots if f"({p})" not in r.markdown]
    return [
        f"## {r.title}",
        "",
        f"*`bench/{script_of(r.name)}.py` → `bench/results/{r.name}.md`, written {r.written}.*",
        "",
        *body,
        *(f"\n![{p}]({p})" for p in extra),
        "",
    ]


def coverage(results: list[BenchResult]) -> list[str]:
    """Issue 9's list of benchmarks, each with where its results are (or that they are missing)."""
    have = {r.name: r for r in results}
    lines = []
    for what, name in COVERAGE:
        r = have.get(name)
        where = f"[{r.title}](#{anchor(r.title)})" if r else f"no `bench/results/{name}.md` yet"
        lines.append(f"- {what}: {where}")
    return lines


def build(results_dir: Path, repo: Path) -> str:
    """The whole report."""
    results = load(results_dir)
    lines = [
        "# fedshard benchmark report",
        "",
        "Written by `make bench` (`bench/report`) from `bench/results/`: every benchmark measures "
        "its alternatives side by side in one run on this machine; each section below is that "
        "benchmark's own results file. Ratios compare numbers from the same run.",
        "",
        *stamp(repo),
        "",
        "## Headlines",
        "",
        *headline_table(results),
        "",
        "## What is measured where",
        "",
        *coverage(results),
        "",
    ]
    for r in results:
        lines += section(r)
    return "\n".join(lines).rstrip() + "\n"


def write(results_dir: Path, repo: Path) -> Path:
    """Write ``REPORT.md`` into ``results_dir``; returns its path."""
    path = results_dir / REPORT
    tmp = path.with_suffix(".tmp")
    tmp.write_text(build(results_dir, repo))
    tmp.replace(path)
    return path


def script_of(name: str) -> str:
    """The benchmark that writes results ``name``: the script of that name, else the longest
    script whose name begins it (``generate_qwen`` and ``federated_qwen`` are ``generate.py``'s
    and ``federated.py``'s runs with ``--out`` or ``--name``)."""
    bench = Path(__file__).resolve().parents[1]
    scripts = [p.stem for p in bench.glob("*.py") if not p.stem.startswith("_")]
    owners = [s for s in scripts if name == s or name.startswith(f"{s}_")]
    return max(owners, key=len, default=name)
