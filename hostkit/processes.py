"""Stopping a child process and everything it started, whatever sessions they moved to.

The demo's coordinator and agents, and Flower's SuperLink and SuperNodes (on the coordinator and
on an agent that trains), are started in new sessions (so a terminal's Ctrl-C reaches only
fedshard, which then stops them in order), and they start helpers of their own, some in further
sessions (``flower-superexec``, ``flwr-serverapp``). :func:`stop_tree` therefore collects the
whole tree by parent links before signalling anything, and also signals the child's process
group, which catches helpers whose parent already exited.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import psutil


def stop_tree(proc: subprocess.Popen[bytes], grace_s: float = 10.0, hard: bool = False) -> bool:
    """SIGTERM to ``proc`` and every process it started (SIGKILL at once with ``hard``: a device
    dropping out), SIGKILL to whatever is left after ``grace_s``; whether ``proc`` itself was
    still running."""
    running = proc.poll() is None
    tree = _tree(proc.pid) if running else []
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill() if hard else member.terminate()
    if running:
        _signal_group(proc.pid, signal.SIGKILL if hard else signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for member in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=grace_s)
    _signal_group(proc.pid, signal.SIGKILL)  # stragglers its group still holds
    return running


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
