"""PNG plots (matplotlib, Agg) that the benchmarks draw next to their Markdown results.

Each function returns ``False`` instead of drawing when matplotlib is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def _figure(path: Path, size: tuple[float, float]) -> Iterator[tuple[Any, Any] | None]:
    """A figure and axes saved to ``path`` on exit; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        yield None
        return
    figure, axes = plt.subplots(1, 1, figsize=size)
    try:
        yield figure, axes
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=110)
    finally:
        plt.close(figure)


def handoff(rows: Sequence[dict[str, Any]], path: Path) -> bool:
    """Median round trip per hop against payload size: TLS, TCP, raw sockets, crypto, copy."""
    series = [
        ("tls_ms", "TLS data plane (agent)", "o-"),
        ("tcp_ms", "plain TCP, same frame code", "s-"),
        ("raw_tls_ms", "raw blocking TLS socket", "o:"),
        ("raw_tcp_ms", "raw blocking TCP socket", "s:"),
        ("crypto_ms", "TLS crypto only (memory BIOs)", "^--"),
        ("copy_ms", "numpy copy", "v-"),
    ]
    sizes = [float(r["size"]) / 2**20 for r in rows]
    with _figure(path, (7.5, 4.5)) as fig:
        if fig is None:
            return False
        _, axis = fig
        for key, label, style in series:
            axis.plot(sizes, [float(r[key]) for r in rows], style, label=label)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(sizes, [str(r["label"]) for r in rows])
        axis.set_xlabel("payload per hop")
        axis.set_ylabel("median round trip (ms)")
        axis.set_title("Hand-off per hop on 127.0.0.1")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    return True


def pipeline(stage_ms: Sequence[float], rps: float, path: Path) -> bool:
    """Each stage's own bound (1 / its compute per request) against the measured throughput."""
    labels = [f"stage {i}" for i in range(len(stage_ms))] + ["pipelined"]
    values = [1e3 / ms for ms in stage_ms] + [rps]
    colors = ["#9bb7d4"] * len(stage_ms) + ["#d47f5f"]
    with _figure(path, (6.5, 4.0)) as fig:
        if fig is None:
            return False
        _, axis = fig
        bars = axis.bar(labels, values, color=colors)
        axis.bar_label(bars, fmt="%.1f", fontsize=8)
        axis.axhline(min(values[:-1]), color="black", linestyle="--", label="slowest-stage bound")
        axis.set_ylabel("requests / s")
        axis.set_title("MiniLM on three agents: throughput against the stage bounds")
        axis.legend(fontsize=8)
    return True


def side_by_side(
    title: str, groups: Sequence[str], series: dict[str, Sequence[float]], unit: str, path: Path
) -> bool:
    """Grouped bars: one group per measure, one bar per engine (``series`` name -> values)."""
    width = 0.8 / max(1, len(series))
    with _figure(path, (7.0, 4.0)) as fig:
        if fig is None:
            return False
        _, axis = fig
        for i, (name, values) in enumerate(series.items()):
            xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
            bars = axis.bar(xs, values, width, label=name)
            axis.bar_label(bars, fmt="%.1f", fontsize=8)
        axis.set_xticks(range(len(groups)), groups, fontsize=8)
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.legend(fontsize=8)
    return True
