"""``stop_tree`` stops a child and the helpers it started in sessions of their own."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from hostkit.processes import stop_tree

PARENT = """
import subprocess, sys, time
helper = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True
)
open(sys.argv[1], "w").write(str(helper.pid))
time.sleep(300)
"""


def _start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    pid_file = tmp_path / "helper.pid"
    proc = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_file)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    return proc, int(pid_file.read_text())


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_child_and_its_helper_in_another_session_are_stopped(tmp_path: Path) -> None:
    proc, helper = _start(tmp_path)
    assert not _gone(helper)
    assert stop_tree(proc, grace_s=5.0) is True
    assert proc.poll() is not None
    deadline = time.monotonic() + 10
    while not _gone(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(helper)
    assert stop_tree(proc, grace_s=1.0) is False  # already stopped: nothing to do
