"""The thin executor: runs ``ip``/``tc`` command lists (never a shell) and removes labs.

:func:`apply` runs a plan's commands and stops at the first failure with a
:class:`LabCommandError`. :func:`teardown` is idempotent and works from any process: it finds
the lab's namespaces by their prefix, stops the lab's processes and everything else still
running inside those namespaces, deletes the namespaces (which removes their veths and the
bridge), and reports every failure at the end instead of stopping at the first.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from typing import Protocol

from devtools.lab.errors import (
    LabCommandError,
    LabError,
    LabTeardownError,
    LabUnavailableError,
)
from devtools.lab.plan import Command, lab_prefix
from devtools.lab.procs import process_ref, terminate
from devtools.lab.state import ProcessRef

log = logging.getLogger(__name__)
COMMAND_TIMEOUT_S = 30.0


class Runner(Protocol):
    """Runs one command line; returns its stdout or raises :class:`LabCommandError`."""

    def __call__(self, argv: Sequence[str], what: str = "") -> str:
        """Run ``argv``; ``what`` describes it in errors and logs."""
        ...


def run_command(argv: Sequence[str], what: str = "") -> str:
    """The default :class:`Runner`: ``subprocess.run`` with an argument list and a timeout."""
    log.debug("running %s", " ".join(argv))
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, check=False, timeout=COMMAND_TIMEOUT_S
        )
    except FileNotFoundError as exc:
        raise LabCommandError(argv, 127, f"{argv[0]} not found", what) from exc
    except subprocess.TimeoutExpired as exc:
        raise LabCommandError(argv, -1, f"timed out after {COMMAND_TIMEOUT_S:.0f} s", what) from exc
    if done.returncode != 0:
        raise LabCommandError(argv, done.returncode, done.stderr or done.stdout, what)
    return done.stdout


def require_tools(run: Runner = run_command) -> None:
    """Raise :class:`LabUnavailableError` unless this process can build labs here."""
    if os.geteuid() != 0:
        raise LabUnavailableError("the lab needs root (network namespaces, veth, tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LabUnavailableError(f"`{tool}` (iproute2) is not installed")
    try:
        run(["ip", "netns", "list"], "list namespaces")
    except LabCommandError as exc:
        raise LabUnavailableError(f"`ip netns` does not work here: {exc}") from exc


def unavailable_reason(run: Runner = run_command) -> str:
    """Why labs cannot be built here, in plain words; ``""`` when they can (for skips)."""
    try:
        require_tools(run)
    except LabUnavailableError as exc:
        return str(exc)
    return ""


def apply(commands: Iterable[Command], run: Runner = run_command) -> None:
    """Run ``commands`` in order; the first failure raises :class:`LabCommandError`."""
    for command in commands:
        log.debug("lab: %s", command.what)
        run(command.argv, command.what)


def list_netns(run: Runner = run_command) -> list[str]:
    """Names of every named network namespace (``ip netns list``)."""
    out = run(["ip", "netns", "list"], "list namespaces")
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def lab_netns(lab_id: str, run: Runner = run_command) -> list[str]:
    """The namespaces of lab ``lab_id`` that exist now, hosts before ``ctl``."""
    prefix = lab_prefix(lab_id)
    found = [ns for ns in list_netns(run) if ns.startswith(prefix)]
    return sorted(found, key=lambda ns: (ns == f"{prefix}ctl", ns))


def netns_pids(netns: str, run: Runner = run_command) -> list[int]:
    """Pids of the processes running inside ``netns``."""
    out = run(["ip", "netns", "pids", netns], f"processes in {netns}")
    return [int(word) for word in out.split() if word.isdigit()]


def teardown(lab_id: str, processes: Sequence[ProcessRef] = (), run: Runner = run_command) -> None:
    """Remove lab ``lab_id`` completely; idempotent. Raises :class:`LabTeardownError`.

    ``processes`` (the lab's agents) get SIGTERM first and time to say goodbye over mDNS; then
    anything else still inside the lab's namespaces is stopped, and the namespaces deleted.
    """
    errors: list[LabError] = []
    survivors = terminate(processes, grace_s=5.0)
    try:
        namespaces = lab_netns(lab_id, run)
    except LabCommandError as exc:
        raise LabTeardownError([exc]) from exc
    for ns in namespaces:
        try:
            refs = [r for pid in netns_pids(ns, run) if (r := process_ref(pid)) is not None]
        except LabCommandError as exc:
            errors.append(exc)
            continue
        if refs:
            log.info("stopping %d process(es) left in %s", len(refs), ns)
        survivors += terminate(refs, grace_s=2.0)
    for ns in namespaces:
        try:
            run(["ip", "netns", "del", ns], f"delete namespace {ns}")
        except LabCommandError as exc:
            errors.append(exc)
    errors += [LabError(f"pid {ref.pid} survived SIGKILL") for ref in survivors]
    try:
        left = lab_netns(lab_id, run)
    except LabCommandError as exc:
        errors.append(exc)
    else:
        errors += [LabError(f"namespace {ns} is still there") for ns in left]
    if errors:
        raise LabTeardownError(errors)
    log.info("lab %s removed", lab_id)
