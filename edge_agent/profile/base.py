"""What every roof benchmark of the profile shares: the frozen base of the profile's models and
the best-trial GFLOP/s timer."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from edge_agent.config import RuntimeConfig


class ProfileModel(BaseModel):
    """The base of the profile's models: frozen, unknown fields refused (a cache written by
    another version is measured again)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def best_gflops(
    session: Any,
    feeds: dict[str, np.ndarray],
    flops: float,
    runtime: RuntimeConfig,
    budget_s: float,
    trials: int,
) -> float:
    """GFLOP/s of ``session`` on ``feeds`` (``flops`` a run): the best of ``trials`` trials
    of about ``budget_s / trials`` seconds each, rounded to 3 decimals."""
    session.run(None, feeds)
    start = time.perf_counter()
    session.run(None, feeds)
    one = max(time.perf_counter() - start, 1e-6)
    runs = max(1, int(budget_s / trials / one))
    best = 0.0
    threads = runtime.intra_op_threads
    for _ in range(trials):
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(runs):
            session.run(None, feeds)
        wall = time.perf_counter() - start
        # CPU time per thread is what the runs cost when the cores are not shared with other
        # processes; wall time is the bound when they are not saturated.
        busy = min(wall, max((time.process_time() - cpu_start) / threads, 1e-9))
        best = max(best, flops * runs / busy / 1e9)
    return round(best, 3)
