"""A coordinator and paired agents (three by default) on 127.0.0.1 serving one exported decoder."""

from __future__ import annotations

import contextlib
import re
import secrets
import signal
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from agent_helpers import AgentProc
from coordinator_helpers import (
    CoordinatorProc,
    pair_discovered,
    start_coordinator,
    stop_process,
    unpaired_agents,
)

from devtools.reference import greedy_reference  # noqa: F401  (re-exported for the tests)


@dataclass
class GenLab:
    coordinator: CoordinatorProc
    agents: list[AgentProc]
    export: Path
    client_ctx: ssl.SSLContext
    deploy_out: str


@contextlib.contextmanager
def decoder_lab(
    export: Path,
    tmp: Path,
    model_id: str,
    memory: str,
    cap: str | None,
    agents: int = 3,
    coordinator_args: list[str] | None = None,
    agent_args: list[list[str]] | None = None,
) -> Iterator[GenLab]:
    """Start ``agents`` agents of ``memory`` each (the ``i``-th with ``agent_args[i]``), pair
    them, ``fedshard deploy`` the export (under the planning ``cap`` per device, when given);
    stop everything."""
    suffix = secrets.token_hex(3)
    coordinator = start_coordinator(tmp, extra=coordinator_args)
    try:
        names = [f"g{i}-{suffix}" for i in range(agents)]
        with unpaired_agents(tmp, names, memory, agent_args) as procs:
            pair_discovered(coordinator, procs)
            args = ["deploy", str(export / "model.onnx"), "--name", model_id]
            args += ["--tokenizer", str(export)]
            for name in names if cap is not None else ():
                args += ["--memory-cap", f"{name}={cap}"]
            deployed = coordinator.cli(*args)
            assert deployed.returncode == 0, deployed.stdout + deployed.stderr + coordinator.log()
            context = _coordinator_context(coordinator)
            yield GenLab(coordinator, procs, export, context, deployed.stdout)
    finally:
        stop_process(coordinator.proc)


def _coordinator_context(coordinator: CoordinatorProc) -> ssl.SSLContext:
    """The coordinator's own client identity (to read the agents' metrics as it does)."""
    from coordinator.transport.tls import client_context
    from coordinator.trust.ca import CertificateAuthority
    from coordinator.trust.identity import open_identity

    ca = CertificateAuthority.open(coordinator.state_dir)
    return client_context(open_identity(coordinator.state_dir, ca))


def agent_metric(lab: GenLab, agent: AgentProc, name: str) -> float:
    """One unlabelled metric from an agent's ``/metrics``."""
    with httpx.Client(verify=lab.client_ctx, timeout=10) as client:
        text = client.get(agent.url("/metrics")).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} not in the metrics of {agent.name}"
    return float(match.group(1))


def live_version(lab: GenLab, model_id: str) -> dict[str, Any]:
    """The model's active version as ``GET /v1/deployments`` shows it (segments in stage
    order)."""
    live = lab.coordinator.api().active_version(model_id).model_dump(mode="json")
    return {**live, "segments": sorted(live["segments"], key=lambda p: p["index"])}


def agents_in_stage_order(lab: GenLab, model_id: str) -> list[AgentProc]:
    """The lab's agents in the order of the model's live plan (first stage first)."""
    by_name = {agent.name: agent for agent in lab.agents}
    return [by_name[p["device"]] for p in live_version(lab, model_id)["segments"]]


def stream_completion(
    lab: GenLab, body: dict[str, object], on_piece: Callable[[int], None]
) -> tuple[int, str]:
    """``POST /v1/completions`` of ``body`` streamed: the status (200; a refusal raises
    ApiError) and the text; ``on_piece(n)`` runs after the n-th piece (to act mid-stream). A
    chunk that carries an error fails."""
    pieces: list[str] = []
    for chunk in lab.coordinator.api(timeout=900).stream("/v1/completions", body):
        assert chunk.error is None, chunk
        pieces.append(chunk.text())
        on_piece(len(pieces))
    return 200, "".join(pieces)


def kill_at_piece(agent: AgentProc, piece: int, killed: threading.Event) -> Callable[[int], None]:
    """An ``on_piece`` for :func:`stream_completion` that SIGKILLs ``agent`` after the
    ``piece``-th piece (once) and sets ``killed``."""

    def on_piece(n: int) -> None:
        if n == piece and not killed.is_set():
            agent.proc.send_signal(signal.SIGKILL)
            killed.set()
            time.sleep(0.2)  # let the next steps reach the dead agent

    return on_piece
