"""The demo's serving loop: a lost agent is reported and restarted, as a supervisor would.

The product keeps serving when an agent goes away (the coordinator re-plans on the devices left
and expands back when the device returns). The demo shows that instead of stopping: each pass of
:meth:`AgentSupervisor.poll` prints the coordinator's new failover events (``GET /v1/failover``),
notices agents that exited, and restarts each one :data:`RESTART_AFTER_S` seconds later with its
own state dir (its keys and pairing), so it rejoins and the models expand back onto it. Only the
coordinator exiting ends the demo.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from devtools.demo.procs import AgentChild, CoordinatorChild, DemoProcessError, DemoProcesses
from devtools.demo.steps import Api, DemoStepError

RESTART_AFTER_S = 4.0
"""How long an exited agent stays down before the demo restarts it."""
PLANNED = frozenset({"replanned", "expanded"})
"""Failover events that name a new plan version: the demo says which devices it runs on."""


@dataclass(frozen=True)
class FailoverNote:
    """One failover event as ``GET /v1/failover`` lists it."""

    at: float
    kind: str
    device: str | None
    model_id: str | None
    plan_version: int | None
    """The agents' key of the version (to find its devices)."""
    detail: str
    version: int | None = None
    """The model's version number, as the demo shows it (``MODEL vN``)."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FailoverNote:
        """Parse one entry of the endpoint's ``events`` list."""
        return cls(
            at=float(data["at"]),
            kind=str(data["kind"]),
            device=data.get("device"),
            model_id=data.get("model_id"),
            plan_version=data.get("plan_version"),
            version=data.get("version"),
            detail=str(data.get("detail", "")),
        )

    def sentence(self) -> str:
        """What happened, in words."""
        model = f"{self.model_id} " if self.model_id else ""
        version = f"v{self.version}" if self.version is not None else ""
        words = {
            "lost": f"device {self.device} lost",
            "back": f"device {self.device} is back",
            "recovering": f"{model}{version} lost a device: re-planning on the devices left",
            "replanned": f"{model}re-planned: now served by {version}",
            "unavailable": f"{model}cannot be served now (503)",
            "expanded": f"{model}expanded back: now served by {version}",
            "expand_failed": f"{model}could not expand back",
        }
        text = words.get(self.kind, f"{self.kind} {model}{version}")
        return f"{text} ({self.detail})" if self.detail else text


def plan_devices(deployments: list[dict[str, Any]], model_id: str, plan_version: int) -> list[str]:
    """The devices plan version ``plan_version`` of ``model_id`` runs on, in stage order
    (``GET /v1/deployments``'s records; empty when it is not listed)."""
    for record in deployments:
        if record.get("model_id") != model_id:
            continue
        for version in record.get("versions", []):
            if version.get("plan_version") == plan_version:
                return [str(s["device"]) for s in version.get("segments", [])]
    return []


def placement_words(devices: list[str], lost: set[str]) -> str:
    """What to add to a re-plan's or expansion's sentence: the devices it runs on, and which of
    them were lost and answer again (their "back" event may come later: the coordinator plans on
    a device as soon as it answers steadily)."""
    if not devices:
        return ""
    words = f" on {', '.join(devices)}"
    returned = [device for device in devices if device in lost]
    if returned:
        words += f" ({', '.join(returned)} answered again before this plan was made)"
    return words


def failover_notes(api: Api) -> list[FailoverNote]:
    """Every failover event the coordinator keeps, oldest first."""
    reply = api.get("/v1/failover")
    return [FailoverNote.from_json(e) for e in reply.get("events", [])]


@dataclass
class AgentSupervisor:
    """Restarts agents that exit and narrates what failover did about it."""

    console: Console
    api: Api
    procs: DemoProcesses
    restart_after_s: float = RESTART_AFTER_S
    clock: Callable[[], float] = time.monotonic
    seen: int = 0
    """How many failover events were printed already."""
    down_since: dict[str, float] = field(default_factory=dict)
    """Agents seen exited, by name: when (monotonic)."""
    restarts: dict[str, float] = field(default_factory=dict)
    """Agents restarted, by name: when (wall clock) the last restart was ready."""
    lost: set[str] = field(default_factory=set)
    """Devices whose "lost" event was printed and whose "back" event was not yet."""

    def poll(self) -> list[FailoverNote]:
        """One pass; the failover events that are new since the last pass.

        Raises DemoProcessError when the coordinator has exited or an agent fails to restart.
        """
        self._check_coordinator()
        for child in self._exited_agents():
            if child.name not in self.down_since:
                self.down_since[child.name] = self.clock()
                self.console.print(
                    f"[yellow]agent {child.name} exited with {child.proc.returncode}[/]; "
                    f"the coordinator fails over without it; the demo restarts it in "
                    f"{self.restart_after_s:.0f} s"
                )
            elif self.clock() - self.down_since[child.name] >= self.restart_after_s:
                self._restart(child)
        return self._new_notes()

    def _check_coordinator(self) -> None:
        for child in self.procs.children:
            if isinstance(child, CoordinatorChild) and not child.alive():
                raise DemoProcessError(
                    f"the coordinator exited with {child.proc.returncode}:\n{child.tail()}"
                )

    def _exited_agents(self) -> list[AgentChild]:
        return [c for c in self.procs.children if isinstance(c, AgentChild) and not c.alive()]

    def _restart(self, child: AgentChild) -> None:
        del self.down_since[child.name]
        with self.console.status(f"restarting agent {child.name}..."):
            self.procs.restart_agent(child)
        self.restarts[child.name] = time.time()
        self.console.print(f"[green]agent {child.name} restarted[/] with its state dir")

    def _new_notes(self) -> list[FailoverNote]:
        try:
            notes = failover_notes(self.api)
        except DemoStepError as exc:
            self.console.print(f"[yellow]failover events unavailable: {exc}[/]")
            return []
        if len(notes) < self.seen:  # the coordinator keeps a bounded list
            self.seen = 0
        fresh = notes[self.seen :]
        self.seen = len(notes)
        deployments = self._deployments(fresh)
        for note in fresh:
            if note.kind == "lost" and note.device:
                self.lost.add(note.device)
            elif note.kind == "back" and note.device:
                self.lost.discard(note.device)
            words = ""
            if note.kind in PLANNED and note.model_id and note.plan_version is not None:
                devices = plan_devices(deployments, note.model_id, note.plan_version)
                words = placement_words(devices, self.lost)
            self.console.print(f"[cyan]failover:[/] {note.sentence()}{words}")
        return fresh

    def _deployments(self, notes: list[FailoverNote]) -> list[dict[str, Any]]:
        if not any(note.kind in PLANNED for note in notes):
            return []
        try:
            reply = self.api.get("/v1/deployments")
        except DemoStepError as exc:
            self.console.print(f"[yellow]deployments unavailable: {exc}[/]")
            return []
        return list(reply) if isinstance(reply, list) else []

    def skip_history(self) -> None:
        """Mark the events so far as printed (they belong to before serving began)."""
        self.seen = len(failover_notes(self.api))
