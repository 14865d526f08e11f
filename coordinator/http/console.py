"""API routes the web console needs beyond the core API (bearer token, under ``/v1``)::

    GET  /v1/console/models          deployed models with their kind (encoder or decoder)
    GET  /v1/plan/{model}            the active (or ``?version=N``) plan next to what agents saw
    POST /v1/plan/what-if            re-plan a deployed model on changed budgets, without deploying
    GET  /v1/metrics                 one snapshot of the live metrics (with slow stages)
    GET  /v1/metrics/stream          the same as server-sent events, one per ``?interval=`` s

Live metrics are the coordinator's own request counters (requests/s, latency percentiles,
counted by :class:`~coordinator.console.stats.InferenceCounter`) and each stage's compute, send
and idle shares from its agent's ``/metrics``. Every snapshot also feeds a
:class:`~coordinator.console.slowness.SlownessSampler`:
a stage that persistently runs slower than its
plan is listed under ``slow``, with a what-if that leaves its device out. A stream ends after
:data:`STREAM_SECONDS` so that an open console never holds up the coordinator's shutdown;
clients reconnect.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from coordinator.console.plans import (
    AnalysisCache,
    PlanView,
    deployed_view,
    plan_view,
    read_manifest,
    what_if,
    what_if_devices,
)
from coordinator.console.slowness import SlownessSampler, SlowStage, StageReading
from coordinator.console.stages import StageRates, StageSampler, StageTarget
from coordinator.console.stats import RequestSnapshot, RequestStats
from coordinator.deploy.store import ModelKind, ModelRecord, VersionRecord
from coordinator.errors import DeployError, NotServableError, RequestError, UnknownModelError
from coordinator.transport.agent_client import AgentAddress
from protocols.gguf_card import GgufCard
from protocols.plan import Objective
from protocols.roofs import roof_values

if TYPE_CHECKING:
    from coordinator.fleet.registry import DeviceRecord
    from coordinator.generation.speculative import SpeculationStats
    from coordinator.http.app import Services

STREAM_SECONDS = 10.0
"""How long one metrics stream lasts before the client reconnects."""
MIN_SAMPLE_INTERVAL_S = 0.5
"""Streams asking more often share the last sample."""


class ConsoleModel(BaseModel):
    """A deployed model as the console lists it."""

    model_config = ConfigDict(frozen=True)

    model_id: str
    kind: ModelKind
    """Stored on the version at deploy (its live one, else its newest)."""
    active: int | None
    """The model's version number requests go to (``MODEL vN``)."""
    previous: int | None
    speculative: str = "off"
    """A decoder's speculative decoding setting (``off|lookup|draft|auto``)."""
    speculation_off: str | None = None
    """Why that setting is not in effect (e.g. a graph whose rows are not independent)."""
    speculation_in_effect: str | None = None
    """What runs, in words: ``on: <how it drafts>`` or ``off: <why>`` (None: an encoder)."""
    draft_model: str | None = None
    """The draft model's export directory, when one is set."""
    acceptance_rate: float | None = None
    """Drafted tokens the chain accepted, over all passes so far (None before any)."""
    tokens_per_s: float | None = None
    """Generated tokens per second of chain time in speculative passes (None before any)."""
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    gguf: GgufCard | None = None
    """A model served from a GGUF file: the file's name, architecture, parameters and
    quantization mix, and what building its live version cost the coordinator."""


def console_model(
    record: ModelRecord,
    speculation: Callable[[str], SpeculationStats | None] | None,
    speculation_off: Callable[[str], str | None] | None = None,
) -> ConsoleModel:
    """A model's console entry, with a decoder's speculative decoding counters."""
    newest = _live_or_newest(record)
    kind = newest.kind if newest is not None else "encoder"
    stats = speculation(record.model_id) if speculation is not None else None
    off = speculation_off(record.model_id) if speculation_off is not None else None
    return ConsoleModel(
        model_id=record.model_id,
        kind=kind,
        active=record.active,
        previous=record.previous,
        speculative=record.speculative if kind == "decoder" else "off",
        speculation_off=off if kind == "decoder" else None,
        speculation_in_effect=in_effect(record, off) if kind == "decoder" else None,
        draft_model=record.draft_model if kind == "decoder" else None,
        acceptance_rate=stats.acceptance_rate if stats is not None else None,
        tokens_per_s=stats.tokens_per_s if stats is not None else None,
        drafted_tokens=stats.drafted if stats is not None else 0,
        accepted_tokens=stats.accepted if stats is not None else 0,
        gguf=_card(record),
    )


def in_effect(record: ModelRecord, off: str | None) -> str:
    """A decoder's speculative decoding as it runs: ``on: <how it drafts>`` or ``off: <why>``
    (``off``: why its setting is not in effect, None when it is)."""
    if record.speculative == "off":
        return "off: set off"
    if off is not None:
        return f"off: {off}"
    if record.speculative == "draft":
        return "on: the draft model drafts"
    if record.speculative == "auto" and record.draft_model is not None:
        return "on: prompt lookup drafts, else the draft model"
    return "on: prompt lookup drafts"


def _live_or_newest(record: ModelRecord) -> VersionRecord | None:
    live = record.version(record.active) if record.active else None
    return live or (record.versions[-1] if record.versions else None)


def _card(record: ModelRecord) -> GgufCard | None:
    """The GGUF card of the model's live version (else its newest), if it came from one."""
    version = _live_or_newest(record)
    return version.card if version is not None else None


class WhatIfBody(BaseModel):
    """``POST /v1/plan/what-if``: budgets in bytes by device; devices to leave out."""

    model_config = ConfigDict(extra="forbid")

    model: str
    budgets: dict[str, int] = Field(default_factory=dict)
    drop: list[str] = Field(default_factory=list)
    slowdown: dict[str, float] = Field(default_factory=dict)
    """Devices measured this many times slower than the plan assumed (a device that got busy):
    the what-if prices them with every roof scaled by it, the re-plan on the new measurements."""
    objective: Objective | None = None
    """Defaults to the objective the active version was planned for."""


class WhatIfAnswer(BaseModel):
    """The plan now and the plan the what-if would give."""

    model_config = ConfigDict(frozen=True)

    current: PlanView | None
    what_if: PlanView


class SlowSuggestion(SlowStage):
    """A slow stage, with the what-if that re-plans without its device."""

    what_if: WhatIfBody


class LiveSnapshot(BaseModel):
    """What the Live page shows at one moment."""

    model_config = ConfigDict(frozen=True)

    time: float
    model_id: str | None
    plan_version: int | None
    version: int | None = None
    """The model's version number (``MODEL vN``) of the version sampled."""
    requests: RequestSnapshot
    stages: list[StageRates]
    slow: list[SlowSuggestion] = Field(default_factory=list)
    """Stages that run persistently slower than planned (:mod:`coordinator.console.slowness`)."""


class LiveMetrics:
    """Request counters plus per-stage rates of a model's active version, sampled on demand."""

    def __init__(
        self,
        services: Services,
        stats: RequestStats,
        clock: Callable[[], float] = time.monotonic,
        slowness: SlownessSampler | None = None,
    ) -> None:
        self._services = services
        self.stats = stats
        self._clock = clock
        self._sampler = StageSampler(clock)
        self._slowness = slowness or SlownessSampler()
        self._last: tuple[float, LiveSnapshot] | None = None
        self._lock = threading.Lock()

    def snapshot(self, model_id: str | None) -> LiveSnapshot:
        """A fresh snapshot, or the last one if it is under half a second old (same model)."""
        with self._lock:
            now = self._clock()
            last = self._last
            fresh = last is not None and now - last[0] < MIN_SAMPLE_INTERVAL_S
            if last is not None and fresh and model_id in (None, last[1].model_id):
                return last[1]
            version = self._version(model_id)
            stages = self._sampler.sample(self._targets(version)) if version else []
            snap = LiveSnapshot(
                slow=self._slow(version, stages) if version else [],
                time=time.time(),
                model_id=version.model_id if version else model_id,
                plan_version=version.plan_version if version else None,
                version=version.version if version else None,
                requests=self.stats.snapshot(),
                stages=stages,
            )
            self._last = (now, snap)
            return snap

    def _slow(self, version: VersionRecord, stages: list[StageRates]) -> list[SlowSuggestion]:
        readings = []
        for placement, rates in zip(version.segments, stages, strict=True):
            counters = self._sampler.last(placement.device)
            if rates.error is not None or counters is None:
                continue
            readings.append(
                StageReading(
                    plan_version=version.plan_version,
                    index=placement.index,
                    device=placement.device,
                    expected_s=placement.predicted_compute_s or placement.warmup_s,
                    at=counters.at,
                    compute_s=counters.compute_s,
                    requests=counters.compute_count,
                )
            )
        return [
            SlowSuggestion(
                **stage.model_dump(),
                what_if=WhatIfBody(model=version.model_id, slowdown={stage.device: stage.slowdown}),
            )
            for stage in self._slowness.observe(readings)
        ]

    def _version(self, model_id: str | None) -> VersionRecord | None:
        serving = self._services.serving
        if serving is None:
            return None
        if model_id is None:
            live = [m.model_id for m in serving.store.book().models if m.active is not None]
            if not live:
                return None
            model_id = live[0]
        return serving.store.active(model_id)

    def _targets(self, version: VersionRecord) -> list[StageTarget]:
        agents = self._services.agents
        if agents is None:
            return []

        def fetcher(address: AgentAddress) -> Callable[[], str]:
            return lambda: agents.metrics(address)

        return [
            StageTarget(p.index, p.device, fetcher(AgentAddress(p.device, p.host, p.control_port)))
            for p in version.segments
        ]


def mount_console_api(v1: APIRouter, services: Services) -> RequestStats:
    """Add the console routes to the token-protected ``v1``; the request counters they show
    (for an :class:`~coordinator.console.stats.InferenceCounter` to fill)."""
    stats = RequestStats()
    v1.include_router(console_router(services, LiveMetrics(services, stats)))
    return stats


def console_router(services: Services, live: LiveMetrics) -> APIRouter:
    """The console's routes (mount under the token-protected ``/v1``)."""
    api = APIRouter()
    analyses = AnalysisCache()

    @api.get("/console/models")
    def console_models() -> list[ConsoleModel]:
        if services.serving is None:
            return []
        return [
            console_model(m, services.speculation, services.speculation_off)
            for m in services.serving.store.book().models
        ]

    @api.get("/plan/{model_id}")
    async def plan(model_id: str, version: int | None = None) -> PlanView:
        record = _version(services, model_id, version)
        return await run_in_threadpool(_deployed, services, analyses, record)

    @api.post("/plan/what-if")
    async def plan_what_if(body: WhatIfBody) -> WhatIfAnswer:
        record = _version(services, body.model, None)
        return await run_in_threadpool(_what_if, services, analyses, record, body)

    @api.get("/metrics")
    async def metrics(model: str | None = None) -> LiveSnapshot:
        return await run_in_threadpool(live.snapshot, model)

    @api.get(
        "/metrics/stream",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}},
    )
    async def metrics_stream(
        request: Request,
        model: str | None = None,
        interval: float = Query(default=1.0, ge=0.25, le=10.0),
    ) -> StreamingResponse:
        if model is not None:
            _version(services, model, None)  # an unknown model is refused before streaming
        events = _events(request, live, model, interval)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    return api


async def _events(
    request: Request, live: LiveMetrics, model: str | None, interval: float
) -> AsyncIterator[str]:
    """Server-sent events: ``retry``, then one ``data:`` snapshot per interval until the end."""
    yield "retry: 1000\n\n"
    ends = time.monotonic() + STREAM_SECONDS
    while time.monotonic() < ends and not await request.is_disconnected():
        try:
            snap = await run_in_threadpool(live.snapshot, model)
        except (UnknownModelError, NotServableError) as exc:
            yield f"event: problem\ndata: {json.dumps({'detail': str(exc)})}\n\n"
        else:
            yield f"data: {snap.model_dump_json()}\n\n"
        await asyncio.sleep(interval)


def _version(services: Services, model_id: str, number: int | None) -> VersionRecord:
    """``model_id``'s version ``number`` (the model's own numbering), else its active one."""
    if services.serving is None:
        raise UnknownModelError(f"no model {model_id!r} is deployed")
    if number is None:
        return services.serving.store.active(model_id)
    found = services.serving.store.model(model_id).version(number)
    if found is None:
        raise RequestError(f"model {model_id!r} has no version {number}")
    return found


def _unit_names(analyses: AnalysisCache, version: VersionRecord) -> list[str] | None:
    try:
        if version.card is not None:  # built from a GGUF file: its header's units
            # heavy: gguf (the builder room's reader) is not in the coordinator extra
            from coordinator.deploy.gguf_what_if import gguf_unit_names

            return gguf_unit_names(Path(version.source), version.card.weights)
        return [u.name for u in analyses.get(Path(version.source)).units.units]
    except (DeployError, RequestError):
        return None  # the plan is still shown, with unit numbers only


def _deployed(services: Services, analyses: AnalysisCache, version: VersionRecord) -> PlanView:
    manifest = read_manifest(services.state_dir, version)
    budgets = {name: memory for name, (memory, _) in _profiles(services, trusted=False).items()}
    return deployed_view(version, manifest, budgets, _unit_names(analyses, version))


def _what_if(
    services: Services, analyses: AnalysisCache, version: VersionRecord, body: WhatIfBody
) -> WhatIfAnswer:
    profiles = _profiles(services, trusted=True)
    meter = services.serving.links if services.serving is not None else None
    links = meter.links() if meter is not None else []
    requester = meter.requester_links() if meter is not None else []
    devices = what_if_devices(
        profiles, links, body.budgets, body.drop, requester, _roofs(services), body.slowdown
    )
    objective = body.objective or version.objective
    manifest = read_manifest(services.state_dir, version)
    if version.card is not None:  # built from a GGUF file: planned from its header
        # heavy: gguf (the builder room's reader) is not in the coordinator extra
        from coordinator.deploy.gguf_what_if import gguf_what_if

        sessions = manifest.sessions if manifest is not None else None
        new, names = gguf_what_if(
            Path(version.source), devices, objective, version.model_id, version.card.weights,
            sessions,
        )  # fmt: skip
    else:
        analysis = analyses.get(Path(version.source))
        new = what_if(analysis, devices, objective, version.model_id)
        names = [u.name for u in analysis.units.units]
    budgets = {d.name: d.memory_bytes for d in devices.devices}
    current = deployed_view(version, manifest, budgets, names)
    return WhatIfAnswer(current=current, what_if=plan_view(version.model_id, new, names, budgets))


def _roofs(services: Services) -> dict[str, dict[str, float | None]]:
    """Every known device's announced roofs beyond GFLOP/s (what a deploy plans with): one it
    does not announce is left out (the device's default), the cache's bandwidth at its memory
    roof."""
    roofs = {}
    for record in services.registry.devices(online_only=False):
        profile = record.announcement.profile
        if profile.memory_gbps is not None:
            announced = {k: v for k, v in roof_values(profile).items() if v is not None}
            roofs[record.name] = {
                **announced,
                "cache_gbps": profile.cache_gbps or profile.memory_gbps,
            }
    return roofs


def _profiles(services: Services, trusted: bool) -> dict[str, tuple[int, float]]:
    """Announced (memory budget, GFLOP/s) by device name: trusted online devices, or all."""
    records: list[DeviceRecord]
    if trusted and services.trust is not None:
        records = services.trust.trusted()
    elif trusted:
        records = [
            r
            for r in services.registry.devices()
            if services.pairing.is_trusted(r.name, r.fingerprint)
        ]
    else:
        records = services.registry.devices(online_only=False)
    return {
        r.name: (r.announcement.profile.memory_bytes, r.announcement.profile.gflops)
        for r in records
    }
