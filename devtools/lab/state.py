"""The lab's state file ``<state dir>/lab.json``: what was made, so any process can remove it.

It is written before the first namespace is created (status ``creating``), again once the lab
is ready, and removed by a complete teardown. Processes are recorded with their start time so
that a recycled pid is never mistaken for one of the lab's.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Final, Literal

from pydantic import Field

from devtools.lab.errors import LabStateError
from devtools.lab.plan import LabPlan
from protocols.base import FrozenModel
from protocols.errors import SchemaError

STATE_FILE: Final = "lab.json"
LAB_FORMAT: Final = "fedshard.lab/1"
LATENCY_NOTE: Final = (
    "latency_ms is recorded, not shaped: this kernel has no netem. Add it in the application "
    "(a pair's latency is the sum of both hosts' latency_ms); bandwidth is shaped with tbf."
)


class ProcessRef(FrozenModel):
    """A process, told apart from a later one with the same pid by its start time."""

    pid: int = Field(gt=0)
    start_ticks: int = Field(ge=0)
    """Field 22 of ``/proc/PID/stat``: clock ticks after boot when the process started."""


class AgentRecord(FrozenModel):
    """An edge agent the lab started."""

    host: str
    process: ProcessRef
    log: str
    state_dir: str


class LabState(FrozenModel):
    """Everything ``lab down`` needs, and what ``lab status`` shows."""

    format: Literal["fedshard.lab/1"] = LAB_FORMAT
    plan: LabPlan
    status: Literal["creating", "ready", "stopping"]
    supervisor: ProcessRef | None
    """The ``lab up`` process that owns the lab; ``lab down`` asks it to stop first."""
    created_at: str = Field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat())
    agents: tuple[AgentRecord, ...] = ()
    latency_note: str = LATENCY_NOTE


def state_path(state_dir: Path) -> Path:
    """Where the state file of the lab in ``state_dir`` lives."""
    return state_dir / STATE_FILE


def save_state(state: LabState, state_dir: Path) -> None:
    """Write the state file atomically (write, fsync, rename)."""
    path = state_path(state_dir)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        with tmp.open("w", encoding="utf-8") as out:
            out.write(state.to_json())
            out.flush()
            os.fsync(out.fileno())
        tmp.replace(path)
    except OSError as exc:
        raise LabStateError(f"cannot write {path}: {exc}") from exc


def load_state(state_dir: Path) -> LabState | None:
    """The state of the lab in ``state_dir``, or None when there is none."""
    path = state_path(state_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LabStateError(f"cannot read {path}: {exc}") from exc
    try:
        return LabState.from_json(data)
    except SchemaError as exc:
        raise LabStateError(f"{path} is not a lab state file: {exc}") from exc


def remove_state(state_dir: Path) -> None:
    """Delete the state file (nothing happens if it is already gone)."""
    try:
        state_path(state_dir).unlink(missing_ok=True)
    except OSError as exc:
        raise LabStateError(f"cannot remove {state_path(state_dir)}: {exc}") from exc
