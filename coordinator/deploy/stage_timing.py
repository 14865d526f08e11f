"""Per-device corrections from predicted to measured stage time, learnt at every deploy.

At deploy time each agent times its own segment at the planned shapes in steady state (the
median of its warm-up runs after the first) and reports it next to the plan's prediction
(:class:`~protocols.deploy.DeployReport`). A device's *correction* is how much slower (above 1)
or faster than its roofs it really runs: later plans price it with every roof scaled by it
(:func:`corrected`), so the time of any work on it is multiplied by the correction.

How the work of a model is spread over its units comes from the roofline itself: besides
compute and bandwidth, each agent's profile measures what an operator, a segment run and a
``TopK`` element cost, which is what small decode-step units are made of. Only for agents
without a memory roof (priced by FLOPs alone) does the coordinator time every unit on its own
machine when it cuts a small model (``fedshard split --calibrate``'s path,
:func:`calibrates_at_deploy`) and spread the FLOP time by those shares. The per-device
correction then only has to say how fast the device is, not how its stage is made up, so it
still holds when a later plan gives the device other units.

The correction is the geometric mean of the measured/predicted ratios of the last
:data:`WINDOW` deploys, each taken against the uncorrected roofs. It is kept per device in
``STATE/stage-timing.json`` and clamped to [:data:`LOWEST`, :data:`HIGHEST`], so one odd
measurement (a device that was briefly busy) cannot make a device look free or useless.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, PositiveFloat, ValidationError

from coordinator.deploy.plan import LiveDevice
from coordinator.deploy.store import VersionRecord
from protocols.base import FrozenModel
from protocols.devices import DeviceList

log = logging.getLogger(__name__)

FILE_NAME = "stage-timing.json"
CALIBRATE_MAX_BYTES = 256 << 20
"""Models up to this size (file plus external data) have their units timed at deploy."""
CALIBRATION_RUNS = 10
WINDOW = 5
LOWEST = 0.05
HIGHEST = 20.0
MIN_MEASURED_S = 1e-6
"""Stage times below this (1 us) are timer noise and teach nothing."""


@dataclass(frozen=True)
class StageTime:
    """One deployed stage: the plan's prediction and the agent's steady-state measurement."""

    device: str
    predicted_s: float
    measured_s: float


class DeviceTiming(FrozenModel):
    """The uncorrected measured/predicted ratios of one device's latest deploys."""

    ratios: list[PositiveFloat] = Field(default_factory=list, max_length=WINDOW)


class TimingFile(FrozenModel):
    """``STATE/stage-timing.json``."""

    devices: dict[str, DeviceTiming] = Field(default_factory=dict)


def correction_of(timing: DeviceTiming) -> float:
    """The geometric mean of ``timing``'s ratios, clamped; 1 without any."""
    if not timing.ratios:
        return 1.0
    mean = math.exp(math.fsum(math.log(r) for r in timing.ratios) / len(timing.ratios))
    return min(HIGHEST, max(LOWEST, mean))


def corrected(device: LiveDevice, factor: float) -> LiveDevice:
    """``device`` with its roofs scaled so every work takes ``factor`` times as long."""
    if factor == 1.0:
        return device
    return dataclasses.replace(
        device,
        gflops=device.gflops / factor,
        memory_gbps=None if device.memory_gbps is None else device.memory_gbps / factor,
        cache_gbps=None if device.cache_gbps is None else device.cache_gbps / factor,
        op_us=device.op_us * factor,
        call_us=device.call_us * factor,
        topk_ns=device.topk_ns * factor,
        correction=factor,
    )


class StageTiming:
    """The corrections of every device, persisted in the coordinator's state directory."""

    def __init__(self, state_dir: Path | None) -> None:
        self._path = None if state_dir is None else state_dir / FILE_NAME
        self._lock = threading.Lock()
        self._file = self._load()

    def factor(self, device: str) -> float:
        """The correction of ``device`` (1 for a device never deployed to)."""
        with self._lock:
            return correction_of(self._file.devices.get(device, DeviceTiming()))

    def factors(self) -> dict[str, float]:
        """Every known device's correction."""
        with self._lock:
            return {name: correction_of(t) for name, t in self._file.devices.items()}

    def apply(self, devices: Sequence[LiveDevice]) -> list[LiveDevice]:
        """``devices`` as later plans should see them: each with its correction applied."""
        return [corrected(d, self.factor(d.name)) for d in devices]

    def record(self, stages: Sequence[StageTime], applied: Mapping[str, float]) -> None:
        """Learn from the measured stages of a deploy planned with the ``applied`` corrections
        (a prediction made with correction ``c`` is ``c`` times the uncorrected one)."""
        with self._lock:
            devices = dict(self._file.devices)
            for stage in stages:
                factor = applied.get(stage.device, 1.0)
                if stage.predicted_s <= 0 or stage.measured_s < MIN_MEASURED_S:
                    continue
                ratio = stage.measured_s / (stage.predicted_s / factor)
                old = devices.get(stage.device, DeviceTiming()).ratios
                devices[stage.device] = DeviceTiming(ratios=[*old, ratio][-WINDOW:])
                log.info(
                    "%s: stage measured %.3f ms, predicted %.3f ms (x%.2f); correction now %.2f",
                    stage.device,
                    stage.measured_s * 1e3,
                    stage.predicted_s * 1e3,
                    stage.measured_s / stage.predicted_s,
                    correction_of(devices[stage.device]),
                )
            self._file = TimingFile(devices=devices)
            self._save()

    def _load(self) -> TimingFile:
        if self._path is None or not self._path.exists():
            return TimingFile()
        try:
            return TimingFile.model_validate_json(self._path.read_bytes())
        except (OSError, ValidationError) as exc:
            log.warning("ignoring unreadable %s: %s", self._path, exc)
            return TimingFile()

    def _save(self) -> None:
        if self._path is None:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._file.model_dump(), indent=2))
        tmp.replace(self._path)


def stage_times(version: VersionRecord) -> list[StageTime]:
    """Each placed segment's predicted and measured (steady-state warm-up) stage time."""
    return [
        StageTime(device=p.device, predicted_s=p.predicted_compute_s, measured_s=p.warmup_s)
        for p in version.segments
    ]


def calibrates_at_deploy(model_path: Path, devices: DeviceList | None = None) -> bool:
    """Whether a deploy of ``model_path`` onto ``devices`` times its units first: only for
    devices priced by FLOPs alone (agents without a memory roof), and only small models (a
    second or two; the file and its external data up to :data:`CALIBRATE_MAX_BYTES`).

    Devices with both roofs are priced by the roofline, whose operator, call and selection
    costs already say how the time is spread over the units; unit times measured here, one
    ``session.run`` per unit, would charge every unit a call of its own (tiny-llama: 11 calls
    of 7-12 us against the 2 of its two-stage plan) and bring this machine's load into it."""
    if devices is not None and all(d.memory_gbps is not None for d in devices.devices):
        return False
    try:
        size = model_path.stat().st_size
        size += sum(p.stat().st_size for p in model_path.parent.glob(f"{model_path.name}*.data"))
        size += sum(p.stat().st_size for p in model_path.parent.glob(f"{model_path.stem}.data"))
    except OSError:
        return False
    return size <= CALIBRATE_MAX_BYTES
