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


@dataclass(frozen=True)
class FailoverNote:
    """One failover event as ``GET /v1/failover`` lists it."""

    at: float
    kind: str
    device: str | None
    model_id: str | None
    plan_version: int | None
    detail: str

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FailoverNote:
        """Parse one entry of the endpoint's ``events`` list."""
        return cls(
            at=float(data["at"]),
            kind=str(data["kind"]),
            device=data.get("device"),
            model_id=data.get("model_id"),
            plan_version=data.get("plan_version"),
            detail=str(data.get("detail", "")),
        )

    def sentence(self) -> str:
        """What happened, in words."""
        model = f"{self.model_id} " if self.model_id else ""
        version = f"v{self.plan_version}" if self.plan_version is not None else ""
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
        for note in fresh:
            self.console.print(f"[cyan]failover:[/] {note.sentence()}")
        return fresh

    def skip_history(self) -> None:
        """Mark the events so far as printed (they belong to before serving began)."""
        self.seen = len(failover_notes(self.api))
