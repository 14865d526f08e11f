"""Following a ``flwr run`` on the coordinator: poll the ServerApp's record until it is done.

Both ServerApps (the shard-wise one and the LoRA one) write their record file after every
round; :func:`follow_run` reads it about once a second and hands it to the caller, which says
when the run is done. Meanwhile it checks that the SuperLink is alive, honours a stop request
and a deadline, and (when the Flower run id is known) asks ``flwr`` every
:data:`STATUS_EVERY_S` seconds how the run stands, so a ServerApp that died without writing a
finished record fails the run with the SuperLink's log instead of waiting out the deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from coordinator.training.errors import TrainingRunError
from coordinator.training.flower import SuperLink, ensure_alive, run_status, tail

POLL_S = 1.0
STATUS_EVERY_S = 15.0
COMPLETED = "finished:completed"

Record = TypeVar("Record")
Result = TypeVar("Result")


def follow_run(
    link: SuperLink,
    run_id: int | None,
    read: Callable[[], Record | None],
    take: Callable[[Record], Result | None],
    *,
    timeout_s: float,
    should_stop: Callable[[], bool],
) -> Result:
    """Poll ``read()`` (None: no record yet) and pass each record to ``take``, until ``take``
    returns a result; raises :class:`TrainingRunError` when the run is stopped, times out, or
    ended in Flower without a record ``take`` accepts."""
    deadline = time.monotonic() + timeout_s
    next_status = time.monotonic() + STATUS_EVERY_S
    while True:
        ensure_alive(link.process, "flower-superlink", link.log_path)
        result = _taken(read, take)
        if result is not None:
            return result
        if should_stop():
            raise TrainingRunError(f"{_run(run_id)} was stopped")
        now = time.monotonic()
        if now > deadline:
            raise TrainingRunError(f"{_run(run_id)} did not finish within {timeout_s:.0f} s")
        if run_id is not None and now > next_status:
            next_status = now + STATUS_EVERY_S
            _check_status(link, run_id, read, take)
        time.sleep(POLL_S)


def _taken(
    read: Callable[[], Record | None], take: Callable[[Record], Result | None]
) -> Result | None:
    record = read()
    return None if record is None else take(record)


def _check_status(
    link: SuperLink,
    run_id: int,
    read: Callable[[], Record | None],
    take: Callable[[Record], Result | None],
) -> None:
    """Raise when Flower says the run ended but the record does not say it finished."""
    status = run_status(link, run_id)
    if status.startswith("finished") and status != COMPLETED:
        raise TrainingRunError(f"run {run_id} ended {status}: {tail(link.log_path)}")
    if status == COMPLETED and _taken(read, take) is None:
        raise TrainingRunError(f"run {run_id} completed without a finished record")


def _run(run_id: int | None) -> str:
    return "the run" if run_id is None else f"run {run_id}"
