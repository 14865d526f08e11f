"""``fedshard demo --chaos``: kill an agent under load, count what was lost, watch it come back.

After the demo is ready it sends its own bounded load (:data:`EMBEDDING_REQUESTS` embeddings
requests from :data:`CLIENTS` clients, and one streamed greedy completion when a decoder is
deployed), kills one agent with SIGKILL while the stream is running, lets the
:class:`~devtools.demo.supervise.AgentSupervisor` restart it, and reports: requests sent,
answered correctly (checked against the whole model run locally in ONNX Runtime), re-sent by the
client after a failure, lost (answered wrongly or never: the target is 0), time to notice, time
to re-plan and time to expand back, read from the coordinator's failover events.

A client does what a well-behaved OpenAI client does: on 503 it waits ``Retry-After`` (at most
:data:`MAX_BACKOFF_S`) and sends again, on a dropped connection or a stream that ends in an error
it sends again, until :data:`REQUEST_DEADLINE_S`.
"""

from __future__ import annotations

import collections
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from coordinator.errors import ApiError
from devtools.demo.steps import MODEL_ID, Api
from devtools.demo.supervise import AgentSupervisor, FailoverNote, failover_notes
from devtools.reference import greedy_reference, unsharded_embeddings

EMBEDDING_REQUESTS = 120
CLIENTS = 4
KILL_AFTER_ANSWERS = 12
"""Embeddings answered before the kill (when there is no stream to kill it under)."""
REQUEST_DEADLINE_S = 180.0
MAX_BACKOFF_S = 2.0
EXPAND_TIMEOUT_S = 240.0
STREAM_TOKENS = 24
STREAM_PROMPT = "The three most useful things a home network router does are"
TEXTS = [
    "A quick brown fox jumps over the lazy dog.",
    "A fast brown fox leaps over a sleepy dog.",
    "Paris is the capital of France.",
    "How do I bake bread at home?",
    "The router forwards packets between the home network and the internet.",
    "Federated learning keeps the training data on the devices.",
]
MIN_COSINE = 0.999


@dataclass
class Tally:
    """What the clients saw; shared by their threads."""

    sent: int = 0
    correct: int = 0
    wrong: int = 0
    resent: int = 0
    lost: int = 0
    refusals: collections.Counter[str] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **counts: int) -> None:
        """Add to counters by name."""
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def refused(self, why: str) -> None:
        """Count one failed attempt by its status (or transport error)."""
        with self.lock:
            self.refusals[why] += 1


@dataclass(frozen=True)
class Timeline:
    """When things happened, in seconds after the kill (or after the restart, for expanding)."""

    notice_s: float | None
    replan_s: dict[str, float | None]
    expand_s: dict[str, float | None]
    """Models whose re-plan used fewer devices than before: when they expanded back."""
    kept_whole: list[str] = field(default_factory=list)
    """Models re-planned on as many devices as before (a spare agent took the lost one's
    place), or onto the lost agent again (it was back before the re-plan): nothing to expand
    back."""
    rejoin_s: float | None = None
    """From the restart to the coordinator counting the device back."""

    @property
    def settled(self) -> bool:
        """Every model was re-planned, every one that shrank expanded back, the device is back."""
        replanned = all(v is not None for v in self.replan_s.values())
        expanded = all(v is not None for v in self.expand_s.values())
        return replanned and expanded and self.rejoin_s is not None


@dataclass(frozen=True)
class ChaosOutcome:
    """The result of one chaos run."""

    victim: str
    sent: int
    correct: int
    wrong: int
    resent: int
    lost: int
    refusals: dict[str, int]
    stream: str
    """The streamed completion's verdict: ``correct``, ``wrong``, ``lost`` or ``none``."""
    timeline: Timeline
    whole_again: bool
    """Every model the kill affected is served on as many devices as before it, or on the
    restarted agent again (the planner may find a narrower plan the better one once the
    agents' measured costs moved: then it must still have expanded back onto the agent)."""

    @property
    def ok(self) -> bool:
        """Nothing lost or wrong, the device back, every model as wide as before the kill."""
        return self.lost == 0 and self.wrong == 0 and self.timeline.settled and self.whole_again


@dataclass(frozen=True)
class ChaosTarget:
    """What the chaos run loads: the encoder's ONNX file, and a decoder export if deployed."""

    encoder: Path
    decoder_id: str | None = None
    decoder_export: Path | None = None


def run_chaos(
    console: Console, api: Api, supervisor: AgentSupervisor, target: ChaosTarget
) -> ChaosOutcome:
    """Run the load, kill an agent, wait for it to come back; print and return the outcome."""
    with console.status("chaos: computing the expected answers with the whole model locally..."):
        expected = unsharded_embeddings(target.encoder, TEXTS)
        reference = None
        if target.decoder_id is not None and target.decoder_export is not None:
            reference, _ = greedy_reference(target.decoder_export, STREAM_PROMPT, STREAM_TOKENS)
    models = [MODEL_ID] + ([target.decoder_id] if target.decoder_id else [])
    victim = _victim(api, target.decoder_id or MODEL_ID)
    before = _active_sizes(api, models, victim)
    supervisor.skip_history()
    tally = Tally()
    first_token = threading.Event()
    answers = threading.Semaphore(0)
    console.print(
        f"chaos: {EMBEDDING_REQUESTS} embeddings requests from {CLIENTS} clients"
        + (f" and one streamed completion from {target.decoder_id}" if reference else "")
        + f"; agent {victim} is killed (SIGKILL) mid-stream"
    )
    with ThreadPoolExecutor(CLIENTS + 1) as pool:
        loads = [
            pool.submit(_embeddings_client, api, expected, tally, answers, i)
            for i in range(CLIENTS)
        ]
        stream = None
        if reference is not None and target.decoder_id is not None:
            stream = pool.submit(_stream_client, api, target.decoder_id, tally, first_token)
        _wait_for_kill_moment(first_token if stream else None, answers)
        killed_at = _kill(console, supervisor, victim)
        while not all(f.done() for f in loads) or (stream and not stream.done()):
            supervisor.poll()
            time.sleep(0.5)
        verdict = "none"
        if stream is not None:
            text = stream.result()
            verdict = "lost" if text is None else "correct" if text == reference else "wrong"
            tally.add(**{verdict: 1})
    timeline = _await_expand_back(supervisor, api, victim, before, killed_at)
    outcome = ChaosOutcome(
        victim=victim,
        sent=tally.sent,
        correct=tally.correct,
        wrong=tally.wrong,
        resent=tally.resent,
        lost=tally.lost,
        refusals=dict(tally.refusals),
        stream=verdict,
        timeline=timeline,
        whole_again=_whole_again(api, victim, before),
    )
    console.print(outcome_table(outcome))
    return outcome


def _victim(api: Api, model_id: str) -> str:
    """The device of the middle segment of the widest active plan (``model_id``'s among equals):
    when a plan uses every agent, losing this one makes it shrink, so it must expand back."""
    plans = []
    for record in api.client().deployments():
        version = record.version(record.active) if record.active is not None else None
        if version is not None:
            plans.append((len(version.segments), record.model_id == model_id, version))
    if not plans:
        raise RuntimeError("nothing is deployed to attack")
    _, _, widest = max(plans, key=lambda plan: plan[:2])
    return widest.segments[len(widest.segments) // 2].device


def _wait_for_kill_moment(
    first_token: threading.Event | None, answers: threading.Semaphore
) -> None:
    if first_token is not None:
        first_token.wait(REQUEST_DEADLINE_S)
        return
    for _ in range(KILL_AFTER_ANSWERS):
        answers.acquire(timeout=REQUEST_DEADLINE_S)


def _kill(console: Console, supervisor: AgentSupervisor, victim: str) -> float:
    child = supervisor.procs.agent(victim)
    killed_at = time.time()
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait(timeout=10)
    console.print(f"[bold red]chaos: killed agent {victim}[/] (pid {child.proc.pid}, SIGKILL)")
    return killed_at


def _embeddings_client(
    api: Api,
    expected: dict[str, Any],
    tally: Tally,
    answers: threading.Semaphore,
    client: int,
) -> None:
    """Send this client's share of the embeddings requests, one at a time, re-sending failures."""
    for n in range(client, EMBEDDING_REQUESTS, CLIENTS):
        texts = [TEXTS[n % len(TEXTS)], TEXTS[(n + 1) % len(TEXTS)]]
        reply = _send(functools.partial(_embed, api, texts), tally)
        if reply is None:
            tally.add(lost=1)
        elif _embeddings_match(reply, texts, expected):
            tally.add(correct=1)
        else:
            tally.add(wrong=1)
        answers.release()


def _embed(api: Api, texts: list[str]) -> tuple[int, Any]:
    return api.call("POST", "/v1/embeddings", {"model": MODEL_ID, "input": texts}, timeout=60)


def _send(call: Callable[[], tuple[int, Any]], tally: Tally) -> Any | None:
    """One request until it is answered 200 or the deadline passes; its body, or None."""
    tally.add(sent=1)
    deadline = time.monotonic() + REQUEST_DEADLINE_S
    first = True
    while time.monotonic() < deadline:
        if not first:
            tally.add(resent=1)
        first = False
        try:
            code, reply = call()
        except httpx.HTTPError as exc:  # the connection dropped or timed out: send again
            tally.refused(type(exc).__name__)
            time.sleep(0.2)
            continue
        if code == 200:
            return reply
        tally.refused(str(code))
        if code < 500 and code != 429:
            return None
        time.sleep(MAX_BACKOFF_S if code in (429, 503) else 0.2)
    return None


def _embeddings_match(reply: Any, texts: Sequence[str], expected: dict[str, Any]) -> bool:
    try:
        vectors = [np.asarray(item["embedding"], dtype=np.float32) for item in reply["data"]]
    except (KeyError, TypeError, ValueError):
        return False
    if len(vectors) != len(texts):
        return False
    return all(
        float(np.dot(v, expected[t]) / (np.linalg.norm(v) * np.linalg.norm(expected[t])))
        >= MIN_COSINE
        for v, t in zip(vectors, texts, strict=True)
    )


def _stream_client(
    api: Api, model_id: str, tally: Tally, first_token: threading.Event
) -> str | None:
    """One streamed greedy completion, re-sent whole if the stream breaks; its text or None."""
    tally.add(sent=1)
    body = {
        "model": model_id,
        "prompt": STREAM_PROMPT,
        "max_tokens": STREAM_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    deadline = time.monotonic() + REQUEST_DEADLINE_S
    attempts = 0
    while time.monotonic() < deadline:
        if attempts:
            tally.add(resent=1)
        attempts += 1
        try:
            text = _read_stream(api, body, first_token, tally)
        except httpx.HTTPError as exc:  # a dropped connection: send again
            tally.refused(type(exc).__name__)
            time.sleep(0.2)
            continue
        if text is not None:
            return text
        time.sleep(MAX_BACKOFF_S)
    return None


def _read_stream(
    api: Api, body: dict[str, Any], first_token: threading.Event, tally: Tally
) -> str | None:
    """The text of one streamed completion, or None when it was refused or ended in an error;
    httpx.HTTPError when the connection dropped (to send it again)."""
    parts: list[str] = []
    try:
        for chunk in api.client(timeout=120).stream("/v1/completions", body):
            if chunk.error is not None:
                tally.refused("stream error")
                return None
            for choice in chunk.choices:
                parts.append(choice.get("text", ""))
                first_token.set()
    except ApiError as exc:
        if exc.status == 0 and isinstance(exc.__cause__, httpx.HTTPError):
            raise exc.__cause__ from None
        tally.refused(str(exc.status))
        return None
    return "".join(parts)


def _plan_devices(api: Api) -> dict[str, dict[int, frozenset[str]]]:
    """The devices each version of each model is planned on."""
    return {
        record.model_id: {
            v.plan_version: frozenset(s.device for s in v.segments) for v in record.versions
        }
        for record in api.client().deployments()
    }


def _active_sizes(api: Api, models: Sequence[str], using: str | None = None) -> dict[str, int]:
    """How many devices each model's active version uses now (only those using device
    ``using``, when given: the models that losing it affects)."""
    return {
        model: len(devices)
        for model, devices in _active_devices(api, models).items()
        if using is None or using in devices
    }


def _active_devices(api: Api, models: Sequence[str]) -> dict[str, list[str]]:
    """Each model's active version's devices now, one per segment."""
    active = {}
    for record in api.client().deployments():
        version = record.version(record.active) if record.active is not None else None
        if record.model_id in models and version is not None:
            active[record.model_id] = [segment.device for segment in version.segments]
    return active


def _whole_again(api: Api, victim: str, before: dict[str, int]) -> bool:
    """:attr:`ChaosOutcome.whole_again`, from the active versions now (one reading)."""
    now = _active_devices(api, list(before))
    return all(
        len(now.get(model, [])) >= size or victim in now.get(model, [])
        for model, size in before.items()
    )


def _await_expand_back(
    supervisor: AgentSupervisor,
    api: Api,
    victim: str,
    before: dict[str, int],
    killed_at: float,
) -> Timeline:
    """Poll until every model is re-planned and every one that shrank expanded back (or the
    timeout)."""
    deadline = time.monotonic() + EXPAND_TIMEOUT_S
    while True:
        supervisor.poll()
        notes = failover_notes(api)
        timeline = _timeline(notes, _plan_devices(api), victim, before, killed_at, supervisor)
        if timeline.settled or time.monotonic() > deadline:
            return timeline
        time.sleep(0.5)


def _timeline(
    notes: Sequence[FailoverNote],
    plans: dict[str, dict[int, frozenset[str]]],
    victim: str,
    before: dict[str, int],
    killed_at: float,
    supervisor: AgentSupervisor,
) -> Timeline:
    after = [n for n in notes if n.at >= killed_at]
    lost = next((n.at for n in after if n.kind == "lost" and n.device == victim), None)
    restarted = supervisor.restarts.get(victim)
    replan: dict[str, float | None] = {}
    expand: dict[str, float | None] = {}
    whole = []
    for model, devices in before.items():
        mine = [n for n in after if n.model_id == model]
        done = next((n for n in mine if n.kind in ("replanned", "unavailable")), None)
        replan[model] = None if done is None else done.at - killed_at
        if done is None:
            continue
        planned = plans.get(model, {}).get(done.plan_version or -1, frozenset())
        # a victim restarted while the re-plan ran is in it: nothing to expand back onto
        shrank = done.kind == "unavailable" or (len(planned) < devices and victim not in planned)
        if not shrank:
            whole.append(model)
            continue
        back = None
        if restarted is not None:
            back = next((n.at for n in mine if n.kind == "expanded" and n.at >= restarted), None)
        expand[model] = None if back is None or restarted is None else back - restarted
    notice = None if lost is None else lost - killed_at
    rejoin = None
    if restarted is not None:
        back_at = next(
            (n.at for n in after if n.kind == "back" and n.device == victim and n.at >= restarted),
            None,
        )
        rejoin = None if back_at is None else back_at - restarted
    return Timeline(notice, replan, expand, whole, rejoin)


def outcome_table(outcome: ChaosOutcome) -> Table:
    """The chaos run's outcome as the demo prints it."""
    table = Table(title=f"chaos: agent {outcome.victim} killed under load", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    refusals = ", ".join(f"{k}: {v}" for k, v in sorted(outcome.refusals.items())) or "none"
    rows = [
        ("requests sent", str(outcome.sent)),
        ("answered correctly", str(outcome.correct)),
        ("answered wrongly", str(outcome.wrong)),
        ("re-sent after a failure", str(outcome.resent)),
        ("lost", str(outcome.lost)),
        ("failed attempts by status", refusals),
        ("streamed completion", outcome.stream),
        ("time to notice", _seconds(outcome.timeline.notice_s)),
    ]
    for model, seconds in outcome.timeline.replan_s.items():
        rows.append((f"time to re-plan {model}", _seconds(seconds)))
    for model, seconds in outcome.timeline.expand_s.items():
        rows.append((f"time to expand {model} back (after the restart)", _seconds(seconds)))
    for model in outcome.timeline.kept_whole:
        rows.append((f"{model} after the re-plan", "nothing to expand back"))
    rows.append(("time to rejoin (after the restart)", _seconds(outcome.timeline.rejoin_s)))
    whole = "yes" if outcome.whole_again else "no"
    rows.append(("every model as wide as before or back on the agent", whole))
    for what, value in rows:
        table.add_row(what, value)
    return table


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"
