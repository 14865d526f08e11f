"""The training-run manager behind ``/v1/training/runs``: one run at a time, in the background.

:class:`TrainingRuns` owns the asyncio task of every run it starts and awaits it on
:meth:`~TrainingRuns.close`; nothing is fired and forgotten. The run itself (Flower processes,
polling, rollout) is blocking work done by a :class:`Runner` in a worker thread, which reports
back through a :class:`RunReporter` as each round finishes, so ``GET`` shows rounds while the run
is still going. A failed run keeps a plain-words error.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from coordinator.errors import CoordinatorError
from coordinator.training.errors import RunConflictError, UnknownRunError
from protocols.ledger import PrivacyStatus
from protocols.training import RunRollout, RunRound, RunState, RunStatus, TrainingRunRequest

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 120.0
"""How long :meth:`TrainingRuns.close` waits for a stopped run to wind down."""


@dataclass(frozen=True)
class LoraSummary:
    """What a finished LoRA run reports besides its rounds."""

    baseline_loss: float | None
    final_loss: float | None
    epsilon_per_device: list[float]
    trained_shard_bytes: int | None
    baseline_recall: float | None = None
    final_recall: float | None = None
    privacy: dict[str, PrivacyStatus] = field(default_factory=dict)
    """Each paired device's privacy ledger after the rounds (device name -> its report)."""


class RunReporter(Protocol):
    """What a runner tells the manager while it works (called from the worker thread)."""

    def running(self, baseline_accuracy: float | None = None) -> None:
        """The federation is up and the first round is under way."""

    def round(self, metrics: RunRound) -> None:
        """A round finished."""

    def rollout(self, rollout: RunRollout) -> None:
        """A new version was written (and rolled out, where a deployment is served)."""

    def summary(self, summary: LoraSummary) -> None:
        """A LoRA run's held-out losses, each device's epsilon, the trained weights' size."""


class Runner(Protocol):
    """Does one run, blocking; raises an exception whose text says what went wrong."""

    def run(
        self, run_id: str, request: TrainingRunRequest, report: RunReporter, stop: threading.Event
    ) -> None:
        """Run ``request`` to the end, or until ``stop`` is set."""


class _Run:
    """One run's state; every change goes through the manager's lock."""

    def __init__(self, run_id: str, lock: threading.Lock, request: TrainingRunRequest) -> None:
        self._lock = lock
        self.status = RunStatus(
            run_id=run_id,
            status="starting",
            model_id=request.model,
            method=request.resolved_method,
        )

    def _update(self, **fields: object) -> None:
        with self._lock:
            self.status = self.status.model_copy(update=fields)

    def running(self, baseline_accuracy: float | None = None) -> None:
        self._update(status="running", baseline_accuracy=baseline_accuracy)

    def round(self, metrics: RunRound) -> None:
        with self._lock:
            rounds = [*self.status.rounds, metrics]
            self.status = self.status.model_copy(update={"status": "running", "rounds": rounds})

    def rollout(self, rollout: RunRollout) -> None:
        with self._lock:
            done = [*self.status.rollouts, rollout]
            self.status = self.status.model_copy(update={"rollouts": done})

    def summary(self, summary: LoraSummary) -> None:
        self._update(
            baseline_loss=summary.baseline_loss,
            final_loss=summary.final_loss,
            epsilon_per_device=list(summary.epsilon_per_device),
            trained_shard_bytes=summary.trained_shard_bytes,
            baseline_recall_at_1=summary.baseline_recall,
            final_recall_at_1=summary.final_recall,
            privacy_per_device=dict(summary.privacy),
        )

    def end(self, state: RunState, error: str | None = None) -> None:
        self._update(status=state, error=error)


class TrainingRuns:
    """Starts runs on a :class:`Runner`, keeps their status, and cleans up after them."""

    def __init__(
        self, runner: Runner, ready: Callable[[TrainingRunRequest], None] | None = None
    ) -> None:
        self._runner = runner
        self._ready = ready
        """Raises when the request cannot start (no training target, a model that is not
        served or cannot be trained): checked by :meth:`start`, quickly, on the event loop."""
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._task: asyncio.Task[None] | None = None
        self._stop = threading.Event()

    async def start(self, request: TrainingRunRequest) -> str:
        """Start a run in the background; raises RunConflictError while another is going."""
        if self._ready is not None:
            self._ready(request)
        if self._task is not None and not self._task.done():
            raise RunConflictError("a training run is already going; wait for it to finish")
        if self._task is not None:
            await self._task  # finished: collect it
        run_id = uuid.uuid4().hex[:12]
        run = _Run(run_id, self._lock, request)
        with self._lock:
            self._runs[run_id] = run
        self._stop = threading.Event()
        self._task = asyncio.create_task(self._execute(run, request), name=f"training-{run_id}")
        return run_id

    def get(self, run_id: str) -> RunStatus:
        """A run's status; raises UnknownRunError."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                raise UnknownRunError(f"no training run {run_id!r}")
            return run.status

    def list(self) -> list[RunStatus]:
        """Every run, oldest first."""
        with self._lock:
            return [run.status for run in self._runs.values()]

    async def wait(self) -> None:
        """Until the current run (if any) has ended."""
        if self._task is not None:
            await self._task

    async def close(self) -> None:
        """Ask the current run to stop and wait for it (bounded); a run cut short fails."""
        if self._task is None:
            return
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.error("training run did not stop within %.0f s", CLOSE_TIMEOUT_S)

    async def _execute(self, run: _Run, request: TrainingRunRequest) -> None:
        run_id = run.status.run_id
        try:
            await asyncio.to_thread(self._runner.run, run_id, request, run, self._stop)
        except CoordinatorError as exc:
            log.warning("training run %s failed: %s", run_id, exc)
            run.end("failed", plain_error(exc))
        except Exception as exc:  # the run's outcome is recorded, not raised into the loop
            log.exception("training run %s failed unexpectedly", run_id)
            run.end("failed", plain_error(exc))
        else:
            run.end("finished")


def plain_error(exc: BaseException) -> str:
    """One short line for the console: the message, or the error's kind when it has none."""
    text = " ".join(str(exc).split())
    if not text:
        text = type(exc).__name__
    if not isinstance(exc, CoordinatorError):
        text = f"unexpected error ({type(exc).__name__}): {text}"
    return text[:500]
