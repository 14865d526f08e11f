"""Resident memory of ``bench/soak.py``'s processes over time: the sampler, the growth after
warm-up of each process, and the plot.

Growth of one process is the median resident set over the last ``window`` seconds of the run
against the median over the first ``window`` seconds after its warm-up (for a process started
again during the run, the warm-up counts from its restart), so that a single spike (a training
round, a burst of sessions) neither hides nor fakes a trend; the least-squares slope over every
sample after warm-up is reported next to it.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

MiB = 1 << 20
CHILDREN = "coordinator's children (sum)"
"""The series of everything the coordinator started (a training run's SuperLink, SuperNodes and
Flower apps): transient by design, plotted, not judged."""


@dataclass
class MemoryLog:
    """Resident memory of every process over time: (seconds since start, bytes) by name."""

    started: float = field(default_factory=time.monotonic)
    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def sample(self, pids: dict[str, int], children_of: int | None = None) -> None:
        """One sample of each process still running, and the sum over ``children_of``'s
        descendants (0 when it has none)."""
        now = time.monotonic() - self.started
        for name, pid in pids.items():
            try:
                rss = int(psutil.Process(pid).memory_info().rss)
            except psutil.Error:
                continue
            self.samples.setdefault(name, []).append((now, rss))
        if children_of is not None:
            self.samples.setdefault(CHILDREN, []).append((now, _descendants_rss(children_of)))

    def peak(self, name: str) -> int:
        """The largest resident set seen for ``name``."""
        return max(rss for _, rss in self.samples.get(name, [(0.0, 0)]))

    def now(self) -> float:
        """Seconds since the log started."""
        return time.monotonic() - self.started


def _descendants_rss(pid: int) -> int:
    total = 0
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return 0
    for child in children:
        try:
            total += int(child.memory_info().rss)
        except psutil.Error:
            continue
    return total


def sampler(
    pids: Callable[[], dict[str, int]],
    log: MemoryLog,
    stop: threading.Event,
    every_s: float = 2.0,
    children_of: int | None = None,
) -> None:
    """Sample every ``every_s`` seconds until ``stop``."""
    while not stop.wait(every_s):
        log.sample(pids(), children_of)


@dataclass(frozen=True)
class Growth:
    """One process's resident memory after its warm-up."""

    name: str
    since_s: float
    """When its warm-up ended (seconds into the soak)."""
    baseline: int
    """Median resident bytes over the first window after warm-up."""
    final: int
    """Median resident bytes over the run's last window."""
    peak: int
    """Largest resident bytes after warm-up."""
    slope_mib_per_min: float
    """Least-squares slope over every sample after warm-up."""
    samples: int

    @property
    def growth(self) -> float:
        """``final / baseline - 1``."""
        return self.final / self.baseline - 1.0


def growth(
    log: MemoryLog, warmup_s: float, window_s: float, restarted: dict[str, float]
) -> dict[str, Growth | None]:
    """Each process's :class:`Growth` (None when too little of the run was left after its
    warm-up: less than two windows); ``restarted``: when a process was started again."""
    out: dict[str, Growth | None] = {}
    for name, points in sorted(log.samples.items()):
        if name == CHILDREN:
            continue
        since = restarted.get(name, 0.0) + warmup_s
        after = [(t, rss) for t, rss in points if t >= since]
        if not after or after[-1][0] - since < 2 * window_s:
            out[name] = None
            continue
        end = after[-1][0]
        first = [rss for t, rss in after if t < since + window_s]
        last = [rss for t, rss in after if t >= end - window_s]
        out[name] = Growth(
            name=name,
            since_s=since,
            baseline=int(statistics.median(first)),
            final=int(statistics.median(last)),
            peak=max(rss for _, rss in after),
            slope_mib_per_min=_slope(after) * 60 / MiB,
            samples=len(after),
        )
    return out


def _slope(points: list[tuple[float, int]]) -> float:
    """Least-squares bytes per second."""
    if len(points) < 2:
        return 0.0
    mean_t = statistics.fmean(t for t, _ in points)
    mean_r = statistics.fmean(r for _, r in points)
    num = sum((t - mean_t) * (r - mean_r) for t, r in points)
    den = sum((t - mean_t) ** 2 for t, _ in points)
    return num / den if den else 0.0


def _with_gaps(
    points: list[tuple[float, int]], gap_s: float = 6.0
) -> tuple[list[float], list[float]]:
    """Minutes and MiB, broken (NaN) where no sample came for ``gap_s`` (a killed process)."""
    xs: list[float] = []
    ys: list[float] = []
    for i, (t, rss) in enumerate(points):
        if i and t - points[i - 1][0] > gap_s:
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append(t / 60)
        ys.append(rss / MiB)
    return xs, ys


def plot_memory(
    log: MemoryLog,
    budgets: dict[str, int],
    events: dict[str, float],
    spans: list[tuple[float, float]],
    warmup_s: float,
    out: Path,
    settled_s: float | None = None,
) -> bool:
    """Resident memory over time as a PNG, each agent's budget dotted, the kill and restart as
    dashed lines, training runs shaded, the warm-up's end dash-dotted; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(11, 5.5))
    for name, points in sorted(log.samples.items()):
        xs, ys = _with_gaps(points)
        if name == CHILDREN:
            line = ax.plot(xs, ys, label=name, linestyle="--", linewidth=0.8)[0]
        else:
            line = ax.plot(xs, ys, label=name)[0]
        if name in budgets:
            ax.axhline(budgets[name] / MiB, color=line.get_color(), linestyle=":", linewidth=1)
    for i, (start, end) in enumerate(spans):
        ax.axvspan(start / 60, end / 60, color="tab:green", alpha=0.12,
                   label="training run" if i == 0 else None)  # fmt: skip
    marks = {"warm-up ends": warmup_s}
    if settled_s is not None:
        marks["settled: judged from here"] = settled_s
    for label, at in marks.items():
        ax.axvline(at / 60, color="black", linestyle="-.", linewidth=1)
        ax.text(at / 60, ax.get_ylim()[1] * 0.97, label, rotation=90, va="top", fontsize=8)
    for label, at in events.items():
        ax.axvline(at / 60, color="grey", linestyle="--", linewidth=1)
        ax.text(at / 60, ax.get_ylim()[1] * 0.97, label, rotation=90, va="top", fontsize=8)
    ax.set_xlabel("minutes into the soak")
    ax.set_ylabel("resident MiB (dotted: the agent's --memory budget)")
    ax.set_title("Resident memory of every process: clients, training runs, rogues, a kill")
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


@dataclass(frozen=True)
class Judged:
    """Growth after warm-up two ways: counted from the start (the victim from its restart) and
    counted from the restart for every process (the failover's re-plans, and the expansion
    back onto the restarted agent, load new versions on every agent; the one they replace
    stays loaded for a rollback)."""

    lines: list[str]
    from_start: dict[str, Growth | None]
    settled: dict[str, Growth | None]
    over: list[str]
    """Processes at or over ``target`` after the re-plans settled (or not judged)."""


def judge(
    log: MemoryLog,
    budgets: dict[str, int],
    warmup_s: float,
    window_s: float,
    victim: str,
    restart_s: float,
    target: float,
) -> Judged:
    """The growth table (Markdown lines) and the verdict."""
    from_start = growth(log, warmup_s, window_s, {victim: restart_s})
    names = [n for n in sorted(log.samples) if n != CHILDREN]
    settled = growth(log, warmup_s, window_s, dict.fromkeys(names, restart_s))
    over = [n for n in names if (g := settled.get(n)) is None or g.growth >= target]
    minutes = f"{warmup_s / 60:g}"
    lines = [
        (
            f"**Flat**: every process grew less than {target:.0%} once the failover's "
            "re-plans had settled."
            if not over
            else f"**Not shown flat**: {', '.join(over)} grew {target:.0%} or more once the "
            "failover's re-plans had settled (or had too little run left to judge)."
        ),
        "",
        f"Growth: median resident memory over the last {window_s / 60:g} minutes against the "
        f"median over the first {window_s / 60:g} minutes after warm-up; slope: least squares "
        f"over every sample after warm-up. *Settled* (judged): warm-up ends {minutes} minutes "
        f"after `{victim}` was restarted, for every process, because the failover re-plans "
        "both models without it and then expands them back onto it, loading new versions on "
        "every agent (the version each replaces stays loaded for a one-step rollback, by "
        f"design). *From start*: warm-up ends {minutes} minutes into the run (for `{victim}`, "
        "after its restart), before those re-plans: what the run was first set to judge.",
        "",
        "| process | settled: after warm-up MiB | last window MiB | growth | slope MiB/min "
        "| from start: after warm-up MiB | growth | peak MiB | budget MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        s, f = settled.get(name), from_start.get(name)
        budget = f"{budgets[name] >> 20}" if name in budgets else "-"
        cells = (
            [f"{s.baseline / MiB:.0f}", f"{s.final / MiB:.0f}", f"{100 * s.growth:+.1f} %",
             f"{s.slope_mib_per_min:+.2f}"]
            if s is not None
            else ["-", "-", "too little run", "-"]
        )  # fmt: skip
        cells += (
            [f"{f.baseline / MiB:.0f}", f"{100 * f.growth:+.1f} %"]
            if f is not None
            else ["-", "too little run"]
        )
        lines.append(f"| {name} | {' | '.join(cells)} | {log.peak(name) / MiB:.0f} | {budget} |")
    lines.append(
        f"| {CHILDREN} (training runs; not judged) | - | - | - | - | - | - | "
        f"{log.peak(CHILDREN) / MiB:.0f} | - |"
    )
    return Judged(lines, from_start, settled, over)


def load_log(path: Path) -> tuple[MemoryLog, dict[str, object]]:
    """The samples of a ``soak-memory.json`` and the rest of the document."""
    doc = json.loads(path.read_text())
    log = MemoryLog()
    log.samples = {n: [(float(t), int(r)) for t, r in pts] for n, pts in doc["samples"].items()}
    return log, doc
