"""A lab owned by this process: :class:`Lab` builds it, runs its agents and removes it.

Use it as a context manager (tests and benchmarks do)::

    from devtools.lab.lab import Lab
    from devtools.lab.spec import LabSpec

    with Lab(LabSpec.build(3, bandwidth_mbps="100,50,20"), state_dir) as lab:
        lab.wait_for_agents(timeout_s=60)
        subprocess.run(lab.exec_argv("ctl", ["python", "-m", "my_coordinator", ...]))

Any exception while building (or leaving the ``with`` block) removes everything made so far.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from devtools.lab.errors import LabAgentError, LabStateError, LabTeardownError
from devtools.lab.executor import Runner, apply, lab_netns, require_tools, run_command, teardown
from devtools.lab.plan import CONTROL, LabPlan, new_lab_id, plan_lab
from devtools.lab.procs import is_alive, process_ref, terminate
from devtools.lab.spec import LabSpec
from devtools.lab.state import AgentRecord, LabState, load_state, remove_state, save_state

log = logging.getLogger(__name__)


class Lab:
    """One lab: namespaces on a bridge, tbf shaping, an edge agent per host."""

    def __init__(
        self,
        spec: LabSpec,
        state_dir: Path,
        *,
        lab_id: str | None = None,
        python: str = sys.executable,
        run: Runner = run_command,
    ) -> None:
        self.spec = spec
        self.state_dir = Path(state_dir)
        self.plan: LabPlan = plan_lab(spec, lab_id or new_lab_id())
        self.python = python
        self._run = run
        self._agents: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self._state: LabState | None = None

    @property
    def state(self) -> LabState:
        """The lab's current state (as written to its state file)."""
        if self._state is None:
            raise LabStateError("the lab is not up")
        return self._state

    def up(self) -> LabState:
        """Build the lab and start its agents; on any failure remove what was made, re-raise."""
        require_tools(self._run)
        self._refuse_live_lab()
        if self.plan.agents and not agents_available(self.python):
            raise LabAgentError(
                "the edge agent (python -m edge_agent) is not installed; --no-agents"
            )
        me = process_ref(os.getpid())
        self._save(LabState(plan=self.plan, status="creating", supervisor=me))
        try:
            apply(self.plan.setup_commands(), self._run)
            if self.plan.agents:
                self._start_agents()
            self._save(self.state.model_copy(update={"status": "ready"}))
        except BaseException:
            log.error("lab %s failed to come up; removing what was made", self.plan.lab_id)
            try:
                self.down()
            except LabTeardownError as exc:
                log.error("cleanup after the failed start is incomplete too: %s", exc)
            raise
        log.info("lab %s is up with %d hosts", self.plan.lab_id, len(self.plan.hosts))
        return self.state

    def down(self) -> None:
        """Stop the agents, remove every namespace, veth and bridge, delete the state file.

        Idempotent; raises :class:`LabTeardownError` if something could not be removed (the
        state file is then kept, so ``lab down`` can retry).
        """
        if self._state is not None and self._state.status != "stopping":
            self._save(self._state.model_copy(update={"status": "stopping"}))
        refs = [a.process for a in self._state.agents] if self._state else []
        try:
            teardown(self.plan.lab_id, refs, self._run)
        finally:
            self._reap()
        on_disk = load_state(self.state_dir)
        if on_disk is None or on_disk.plan.lab_id == self.plan.lab_id:
            remove_state(self.state_dir)  # never another lab's state (a refused second up)
        self._state = None

    def __enter__(self) -> Lab:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def exec_argv(self, host: str, command: list[str]) -> list[str]:
        """The argv running ``command`` inside ``host``'s namespace (``ctl``: the coordinator's)."""
        return self.plan.exec_argv(host, command)

    def popen(self, host: str, command: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        """Start ``command`` in ``host``'s namespace (text mode); the lab stops it on down."""
        return subprocess.Popen(self.exec_argv(host, command), text=True, **kwargs)

    def dead_agents(self) -> list[str]:
        """Hosts whose agent has exited."""
        return [name for name, proc in self._agents.items() if proc.poll() is not None]

    def agent_log_tail(self, host: str, lines: int = 20) -> str:
        """The last lines of ``host``'s agent log."""
        path = self.state_dir / host / "agent.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def wait_for_agents(self, timeout_s: float = 90.0) -> list[dict[str, Any]]:
        """Wait until a browser in ``ctl`` discovers every agent over mDNS; returns them.

        Raises :class:`LabAgentError` if an agent exits or is not discovered in time.
        """
        expect = len(self.plan.hosts)
        command = [self.python, "-m", "devtools.lab.probe", "browse"]
        command += ["--interface", self.plan.control.address, "--expect", str(expect)]
        command += ["--timeout", str(timeout_s)]
        browser = self.popen(CONTROL, command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s + 15.0
        try:
            while browser.poll() is None:
                if time.monotonic() > deadline:
                    raise LabAgentError(f"the lab's mDNS browser hung past {timeout_s:.0f} s")
                dead = self.dead_agents()
                if dead:
                    raise LabAgentError(
                        f"agent on {dead[0]} exited:\n{self.agent_log_tail(dead[0])}"
                    )
                time.sleep(0.2)
            out, err = browser.communicate()
        finally:
            if browser.poll() is None:
                browser.terminate()
                browser.wait(5)
        lines = out.strip().splitlines()
        if not lines:
            raise LabAgentError(f"the lab's mDNS browser failed: {err.strip()[-2000:]}")
        result = json.loads(lines[-1])
        devices: list[dict[str, Any]] = result["devices"]
        if not result["found"]:
            seen = ", ".join(d["name"] for d in devices) or "none"
            raise LabAgentError(f"only {len(devices)} of {expect} agents discovered ({seen})")
        return devices

    def _refuse_live_lab(self) -> None:
        existing = load_state(self.state_dir)
        if existing is None:
            return
        supervisor = existing.supervisor
        alive = supervisor is not None and is_alive(supervisor)
        if alive or lab_netns(existing.plan.lab_id, self._run):
            raise LabStateError(
                f"lab {existing.plan.lab_id} still uses {self.state_dir}; "
                f"run `fedshard lab down --state-dir {self.state_dir}` first"
            )
        log.info("replacing the stale state file of lab %s", existing.plan.lab_id)

    def _start_agents(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for host in self.plan.hosts:
            host_dir = self.state_dir / host.name
            agent_dir = host_dir / "agent"
            agent_dir.mkdir(parents=True, exist_ok=True)
            log_path = host_dir / "agent.log"
            log_file = log_path.open("ab")
            self._logs.append(log_file)
            argv = self.plan.agent_argv(host, self.python, agent_dir)
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            self._agents[host.name] = proc
            ref = process_ref(proc.pid)
            if ref is None:
                raise LabAgentError(
                    f"agent on {host.name} exited at once:\n{self.agent_log_tail(host.name)}"
                )
            record = AgentRecord(
                host=host.name, process=ref, log=str(log_path), state_dir=str(agent_dir)
            )
            self._save(self.state.model_copy(update={"agents": (*self.state.agents, record)}))
            log.info("agent %s started (pid %d) on %s", host.name, proc.pid, host.address)

    def _reap(self) -> None:
        for proc in self._agents.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)
        self._agents.clear()
        for log_file in self._logs:
            log_file.close()
        self._logs.clear()

    def _save(self, state: LabState) -> None:
        save_state(state, self.state_dir)
        self._state = state


def agents_available(python: str) -> bool:
    """Whether ``python -m edge_agent`` can run (checked without importing it when possible)."""
    if python != sys.executable:
        return True  # another interpreter: the agent's own start-up reports a missing package
    return importlib.util.find_spec("edge_agent") is not None


def down_from_state(state_dir: Path, run: Runner = run_command, wait_s: float = 20.0) -> str | None:
    """``lab down`` from any process: stop the owning ``lab up``, then remove what is left.

    Returns the id of the lab removed, or None if ``state_dir`` held no lab. Idempotent.
    """
    state = load_state(state_dir)
    if state is None:
        return None
    supervisor = state.supervisor
    if supervisor is not None and supervisor.pid != os.getpid() and is_alive(supervisor):
        log.info("asking lab up (pid %d) to stop", supervisor.pid)
        terminate([supervisor], grace_s=wait_s)
    teardown(state.plan.lab_id, [a.process for a in state.agents], run)
    remove_state(state_dir)
    return state.plan.lab_id
