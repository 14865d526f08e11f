"""Resident memory of ``bench/soak.py``'s processes over time: the sampler, the growth after
warm-up of each process, and the plot.

Growth of one process is the median resident set over the last ``window`` seconds of the run
against the median over the first ``window`` seconds after its warm-up (for a process started
again during the run, the warm-up counts from its restart), so that a single spike (a training
round, a burst of sessions) neither hides nor fakes a trend; the least-squares slope over every
sample after warm-up is reported next to it.
"""

from __future__ import annotations

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
    ax.axvline(warmup_s / 60, color="black", linestyle="-.", linewidth=1)
    ax.text(warmup_s / 60, ax.get_ylim()[1] * 0.97, "warm-up ends", rotation=90, va="top",
            fontsize=8)  # fmt: skip
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
