"""Two paired agents and a coordinator on 127.0.0.1 that deploy the tiny decoders in two
stages, for the stage-time calibration: ``tests/e2e/test_prediction_band.py`` (the mechanism)
and ``bench/prediction_band.py`` (how close the calibrated predictions come)."""

from __future__ import annotations

import secrets
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agent_helpers import AgentProc
from coordinator_helpers import (
    CoordinatorProc,
    pair_discovered,
    start_coordinator,
    stop_process,
    unpaired_agents,
)

CAPS = {"tiny-llama": "14MB", "tiny-gemma3": "16MB"}
"""Per model: the cap on each agent under which no one agent holds it (the embedding and the
output head, 7.8 MB each for tiny-llama, plus the KV cache)."""


@dataclass
class BandLab:
    """The lab's coordinator and its two agents."""

    coordinator: CoordinatorProc
    agents: list[AgentProc]

    def deploy(self, export: Path, model_id: str, cap: str) -> str:
        """Deploy ``export`` under ``model_id`` with every agent capped at ``cap``."""
        args = ["deploy", str(export / "model.onnx"), "--name", model_id]
        args += ["--tokenizer", str(export)]
        for agent in self.agents:
            args += ["--memory-cap", f"{agent.name}={cap}"]
        done = self.coordinator.cli(*args)
        if done.returncode != 0:
            raise RuntimeError(done.stdout + done.stderr + self.coordinator.log())
        return done.stdout

    def active_segments(self, model_id: str) -> list[dict[str, object]]:
        """The active version's segments as ``GET /v1/deployments`` lists them."""
        live = self.coordinator.api().active_version(model_id)
        return [segment.model_dump(mode="json") for segment in live.segments]


@contextmanager
def band_lab(tmp: Path) -> Iterator[BandLab]:
    """A coordinator and two agents (512 MiB each), paired, until the block ends."""
    coordinator = start_coordinator(tmp)
    try:
        names = [f"b{i}-{secrets.token_hex(3)}" for i in range(2)]
        with unpaired_agents(tmp, names, "512MiB") as agents:
            pair_discovered(coordinator, agents)
            yield BandLab(coordinator, agents)
    finally:
        stop_process(coordinator.proc)


def ratios(segments: list[dict[str, object]]) -> list[float]:
    """Each stage's predicted over measured decode-step time."""
    return [float(str(s["predicted_compute_s"])) / float(str(s["warmup_s"])) for s in segments]


def median_ratios(deploys: list[list[dict[str, object]]]) -> list[float]:
    """Per stage, the median of :func:`ratios` over several deploys."""
    runs = [ratios(segments) for segments in deploys]
    return [statistics.median(stage) for stage in zip(*runs, strict=True)]


def slowest_stage(deploys: list[list[dict[str, object]]]) -> int:
    """The index of the stage with the larger median measured time over ``deploys``."""
    measured = [statistics.median(float(str(s[i]["warmup_s"])) for s in deploys) for i in range(2)]
    return measured.index(max(measured))
