"""Processes of the lab: identify them safely (pid plus start time) and stop them.

Only Linux ``/proc`` is read; signals go to single pids, never to names or groups.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable

from devtools.lab.state import ProcessRef

log = logging.getLogger(__name__)


def process_ref(pid: int) -> ProcessRef | None:
    """The :class:`ProcessRef` of a running process, or None if ``pid`` is gone or a zombie."""
    stat = _stat_fields(pid)
    if stat is None or stat[0] == "Z":
        return None
    return ProcessRef(pid=pid, start_ticks=int(stat[19]))


def is_alive(ref: ProcessRef) -> bool:
    """Whether the very process ``ref`` names still runs (a recycled pid does not count)."""
    return process_ref(ref.pid) == ref


def terminate(refs: Iterable[ProcessRef], grace_s: float = 5.0) -> list[ProcessRef]:
    """SIGTERM each live process, SIGKILL those still alive after ``grace_s``.

    Returns the processes that survived even SIGKILL (normally none).
    """
    live = [ref for ref in refs if is_alive(ref) and ref.pid != os.getpid()]
    for ref in live:
        _signal(ref, signal.SIGTERM)
    live = _wait_gone(live, grace_s)
    for ref in live:
        log.warning("pid %d ignored SIGTERM for %.1f s; killing it", ref.pid, grace_s)
        _signal(ref, signal.SIGKILL)
    return _wait_gone(live, 2.0)


def _wait_gone(refs: list[ProcessRef], timeout_s: float) -> list[ProcessRef]:
    deadline = time.monotonic() + timeout_s
    while True:
        refs = [ref for ref in refs if is_alive(ref)]
        if not refs or time.monotonic() >= deadline:
            return refs
        time.sleep(0.05)


def _signal(ref: ProcessRef, sig: signal.Signals) -> None:
    try:
        os.kill(ref.pid, sig)
    except ProcessLookupError:
        log.debug("pid %d already gone", ref.pid)


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            text = stat.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2 :].split()
