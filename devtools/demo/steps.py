"""The steps of ``fedshard demo``, each printing what it shows.

They talk to the coordinator only through its HTTP API (the processes themselves are owned by
:mod:`devtools.demo.procs`), except for the deployment's manifest, which the demo reads from
the coordinator's state directory for the planning units of each segment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.table import Table

from coordinator.commands import PLACEMENT_COLUMNS, placement_cells
from coordinator.deploy.store import segment_dir
from coordinator.errors import ApiError
from protocols.manifest import MANIFEST_FILE
from protocols.pairing import CODE_FILE
from protocols.sizes import parse_size

if TYPE_CHECKING:
    from coordinator.client import CoordinatorClient

MODEL_ID = "all-minilm-l6-v2"
AGENT_MEMORY = "1GiB"
"""Each agent's own budget. Qwen2.5-Coder-1.5B in int4 (1,086 MiB) fits on none of them; Gemma 3
270M in int8 (418 MiB) and MiniLM (90 MB) would, so planning caps keep them off a single device."""
MINILM_CAP_SHARE = 0.65
"""Each device's planning cap for MiniLM as a share of its weights: no single device can hold
the model (nor, once activations are counted, any two), while any three of the four can, so
losing one agent leaves room for a real re-plan. The first stage holds the word embeddings
(51.6% of the weights), so every cap must be above that share."""
SENTENCES = [
    "A quick brown fox jumps over the lazy dog.",
    "A fast brown fox leaps over a sleepy dog.",
    "Paris is the capital of France.",
    "How do I bake bread at home?",
]
PREDICTION_BAND = (0.75, 1.33)
"""Predicted over measured stage time the plan tables aim at (issue 18)."""
REPLANS = 2
"""Re-plans the demo makes at most while a stage's prediction is out of the band."""
PAIR_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Api:
    """The demo's handle on the coordinator's API: :class:`coordinator.client.CoordinatorClient`
    calls as ``(status, JSON reply)``."""

    url: str
    token: str

    def client(self, timeout: float = 60.0) -> CoordinatorClient:
        """The typed client of the same API, for the verbs it has (typed replies, ApiError)."""
        # heavy: httpx (coordinator extra), absent on an agent-only install whose parser imports us
        from coordinator.client import CoordinatorClient

        return CoordinatorClient(self.url, self.token, timeout)

    def call(
        self, method: str, path: str, body: Any = None, timeout: float = 60.0
    ) -> tuple[int, Any]:
        """``(status, JSON reply)`` of one request (a non-JSON reply as ``{"detail": text}``);
        httpx.HTTPError when the coordinator cannot be reached."""
        reply = self.client().call(method, path, body, timeout)
        return reply.status, reply.body

    def get(self, path: str) -> Any:
        """The JSON reply of ``GET path``; DemoStepError unless it is a 200."""
        code, reply = self.call("GET", path)
        if code != 200:
            raise DemoStepError(f"GET {path}: {code} {reply}")
        return reply


class DemoStepError(RuntimeError):
    """A step of the demo failed; the message says which and why."""


def export_model(console: Console, cache: Path) -> Path:
    """all-MiniLM-L6-v2 exported from its package to ONNX (reused when already there)."""
    from partitioner.models.frontdoor import export_minilm

    cache.mkdir(parents=True, exist_ok=True)
    model = cache / "all-MiniLM-L6-v2.onnx"
    if model.exists():
        console.print(f"all-MiniLM-L6-v2 already exported: {model}")
        return model
    partial = cache / "export.onnx"
    with (
        console.status("exporting all-MiniLM-L6-v2 from its package (real weights)..."),
        _quiet_export(),
    ):
        export_minilm(partial)
    partial.replace(model)
    console.print(f"exported all-MiniLM-L6-v2 to {model}")
    return model


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Silence torch's and transformers' export chatter (warnings, progress bars) on screen."""
    loggers = [logging.getLogger(name) for name in ("torch", "transformers", "onnxscript")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            with contextlib.suppress(ImportError):
                from transformers.utils import logging as hf_logging

                hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
                hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def minilm_caps(model: Path, names: Sequence[str]) -> dict[str, int]:
    """MiniLM's planning caps by device name (see :data:`MINILM_CAP_SHARE`)."""
    return {name: int(MINILM_CAP_SHARE * model.stat().st_size) for name in names}


def budgets_table(
    model_name: str,
    model: Path,
    caps: dict[str, int],
    names: Sequence[str] = (),
    weights: int | None = None,
) -> Table:
    """The agents' budgets and one model's planning caps, with what losing one agent leaves.

    Without caps (the model's weights exceed every budget by themselves) the budgets are what
    no agent can hold it under. ``weights``: the model's weights as served (default: the
    file's size)."""
    weights = model.stat().st_size if weights is None else weights
    budget = parse_size(AGENT_MEMORY)
    limits = planning_limits(caps, names)
    left = sum(limits.values()) - max(limits.values())
    why = "under its planning cap" if caps else "in its memory budget"
    if weights > budget:
        why = f"in its memory budget ({budget / 1e6:.0f} MB)"
        if caps:
            why += f", nor half of it under its planning cap ({max(caps.values()) / 1e6:.0f} MB)"
    table = Table(
        title=f"{len(limits)} agents on 127.0.0.1; {model_name}: {weights / 1e6:.0f} MB of weights",
        caption=f"no agent can hold {model_name} alone {why}; after losing any one agent the "
        f"others have {left / 1e6:.0f} MB for it",
    )
    for column in ("device", "agent memory budget", "planning cap"):
        table.add_column(column, justify="right")
    for name, limit in limits.items():
        table.add_row(name, AGENT_MEMORY, f"{limit / 1e6:.0f} MB" if caps else "none")
    return table


def planning_limits(caps: dict[str, int], names: Sequence[str]) -> dict[str, int]:
    """What the planner may put on each agent: its cap, or without caps its memory budget."""
    return caps or dict.fromkeys(names, parse_size(AGENT_MEMORY))


def after_a_loss(api: Api, model_id: str, limits: Mapping[str, int]) -> str:
    """Whether losing any one agent leaves a plan for ``model_id`` within the others' ``limits``
    (caps, or budgets): the coordinator's what-if plans it as a failover would (weights,
    runtime and the sessions' KV reserve), dropping each agent in turn."""
    # heavy: FastAPI (coordinator extra), absent on an agent-only install whose parser imports us
    from coordinator.http.console import WhatIfBody

    stranded = []
    for gone in limits:
        rest = {name: limit for name, limit in limits.items() if name != gone}
        body = WhatIfBody(model=model_id, budgets=rest, drop=[gone])
        try:
            api.client().what_if(body)
        except ApiError as exc:
            if "no plan fits" not in str(exc.detail):
                raise DemoStepError(f"the what-if without {gone} failed: {exc}") from exc
            stranded.append(gone)
    if not stranded:
        return f"{model_id}: losing any one agent leaves a plan on the others (a re-plan, no 503)"
    everyone = len(stranded) == len(limits)
    which = "whichever agent is lost" if everyone else f"without {' or '.join(stranded)}"
    return (
        f"{model_id}: {which}, no plan fits the others' limits (weights, runtime and the "
        "sessions' KV reserve): it would answer 503 (with Retry-After) until the agent is back"
    )


def pair_automatically(
    console: Console, api: Api, agents: Mapping[str, Path], alive: Callable[[], None]
) -> None:
    """Approve each agent's pending pairing request with the code it shows, read from its state
    dir (``agents``: name -> state dir; demo only, the agents run on this machine)."""
    console.print(
        "[bold yellow]demo mode: pairing automatically[/] (a real deployment approves each "
        "agent's code with `fedshard pair NAME CODE` or in the console)"
    )
    wanted = set(agents)
    client = api.client()
    deadline = time.monotonic() + PAIR_TIMEOUT_S
    with console.status("waiting for the agents' pairing requests (mDNS on 127.0.0.1)..."):
        while True:
            alive()
            statuses = _statuses(client, wanted)
            if all(statuses.get(n) == "paired" for n in wanted):
                break
            pending = {p.name for p in client.pairing().pending}
            for name in sorted(wanted):
                shown = agents[name] / CODE_FILE
                if statuses.get(name) != "paired" and name in pending and shown.is_file():
                    typed = shown.read_text().strip()
                    try:
                        client.approve(name, typed)
                    except ApiError as exc:
                        if exc.status != 404:  # 404: the request is gone, asked again
                            raise DemoStepError(f"pairing {name} failed: {exc}") from exc
                    else:
                        console.print(f"  paired {name} (code {typed})")
            if time.monotonic() > deadline:
                raise DemoStepError(f"agents not paired within {PAIR_TIMEOUT_S:.0f} s: {statuses}")
            time.sleep(0.3)
    console.print(f"[green]paired {len(wanted)} agents[/]")


def _statuses(client: CoordinatorClient, names: set[str]) -> dict[str, str]:
    return {d.name: d.status for d in client.devices() if d.online and d.name in names}


def post_deployment(api: Api, body: Mapping[str, Any]) -> dict[str, Any]:
    """``POST /v1/deployments`` of ``body`` (the route's ``DeployBody``): the new version record
    as JSON; DemoStepError when it is refused or the coordinator does not answer."""
    try:
        return api.client().deploy(body).model_dump(mode="json")
    except ApiError as exc:
        model = body.get("model_id", "the model")
        raise DemoStepError(f"deploy of {model} failed ({exc.status}): {exc.detail}") from exc


def deploy_minilm(console: Console, api: Api, model: Path, caps: dict[str, int]) -> dict[str, Any]:
    """POST /v1/deployments with the planning caps; the new version record."""
    body = {"model_path": str(model.resolve()), "model_id": MODEL_ID, "memory_caps": caps}
    started = time.monotonic()
    with console.status(
        "deploying all-MiniLM-L6-v2: measuring links, planning, cutting, signing, pushing "
        "segments, warm-up and health check..."
    ):
        reply = post_deployment(api, body)
    console.print(
        f"[green]deployed {MODEL_ID} v{reply['version']}[/] in "
        f"{time.monotonic() - started:.1f} s across {len(reply['segments'])} devices"
    )
    return dict(reply)


def deploy_calibrated(
    console: Console, api: Api, model_id: str, deploy: Callable[[], object]
) -> None:
    """``deploy()`` a model; while a stage's prediction falls out of :data:`PREDICTION_BAND`,
    say so and deploy it again, planned on what its stages measured (at most
    :data:`REPLANS` times).

    A model's first deploy is priced by the agents' start-up roofs and by factors fitted on
    other models' stages, which read their weights through other kernels; the coordinator
    fits each model's factors on that model's own stages and keeps what they leave
    unexplained per unit (``coordinator.deploy.stage_timing``). A re-plan that cuts a
    measured stage in two prices both parts at the whole stage's residual until they are
    measured apart, so a second re-plan may be needed."""
    deploy()
    low, high = PREDICTION_BAND
    for attempt in range(REPLANS):
        ratios = stage_ratios(api, model_id)
        if all(low <= r <= high for r in ratios):
            return
        shown = ", ".join(f"{r:.2f}" for r in ratios)
        which = "first plan" if attempt == 0 else "re-plan"
        console.print(
            f"{model_id}'s {which} predicted its stages at {shown}x of what the agents "
            f"measured (out of {low}-{high}x): re-planning with those measurements",
            soft_wrap=True,
        )
        deploy()


def stage_ratios(api: Api, model_id: str) -> list[float]:
    """Predicted over measured stage time of each stage of the model's active version."""
    version = _active_version(api, model_id)
    return [
        p["predicted_compute_s"] / p["warmup_s"] for p in version["segments"] if p["warmup_s"] > 0
    ]


def _active_version(api: Api, model_id: str) -> dict[str, Any]:
    try:
        return api.client().active_version(model_id).model_dump(mode="json")
    except ApiError as exc:
        raise DemoStepError(f"{model_id} has no active version: {exc.detail}") from exc


def plan_table(api: Api, state_dir: Path, model_id: str = MODEL_ID) -> Table:
    """A model's active plan next to what the agents measured (GET /v1/deployments)."""
    version = _active_version(api, model_id)
    units = _units(segment_dir(state_dir, model_id, version["plan_version"]))
    table = Table(
        title=f"plan: {model_id} v{version['version']} ({version['objective']}), "
        f"health check max |diff| {version['health_max_abs_diff']:.1e}",
        caption="pred.: the planner's prediction (MB: loading the segment); KV: the memory it "
        "reserves for the sessions' KV cache, allocated per session; meas.: what the agent "
        "measured (resident memory after loading, stage time in the warm-up: one request, or "
        "one decode step of a decoder); prefill: the stage's predicted time for a 64-token "
        "prompt",
    )
    for column in ("segment", "device", "units", *PLACEMENT_COLUMNS):
        table.add_column(column, justify="right", no_wrap=column == "device")
    for p in version["segments"]:
        first, end = units.get(p["index"], (0, 0))
        span = f"{first}-{end - 1}" if end > first else "-"
        table.add_row(str(p["index"]), p["device"], span, *placement_cells(p))
    return table


def _units(version_dir: Path) -> dict[int, tuple[int, int]]:
    """Segment index -> half-open range of planning units, from the version's manifest."""
    try:
        manifest = json.loads((version_dir / MANIFEST_FILE).read_text())
        return {
            int(s["index"]): (int(s["units"][0]), int(s["units"][1])) for s in manifest["segments"]
        }
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return {}


def similarity_table(console: Console, api: Api) -> Table:
    """Cosine similarities of :data:`SENTENCES` embedded by the sharded model."""
    with console.status("embedding four sentences through the three agents (/v1/embeddings)..."):
        try:
            reply = api.client().embeddings(MODEL_ID, SENTENCES)
        except ApiError as exc:
            raise DemoStepError(f"/v1/embeddings failed ({exc.status}): {exc.detail}") from exc
    vectors = np.array(reply.vectors(), dtype=np.float64)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    similarity = vectors @ vectors.T
    table = Table(title="sentence similarity (cosine) from /v1/embeddings")
    table.add_column("#", justify="right")
    table.add_column("sentence")
    for index in range(len(SENTENCES)):
        table.add_column(str(index), justify="right")
    for index, sentence in enumerate(SENTENCES):
        table.add_row(str(index), sentence, *(f"{value:.2f}" for value in similarity[index]))
    return table
