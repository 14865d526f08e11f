"""A coordinator and three agents serving MiniLM on 127.0.0.1, and a load driver for it.

Shared by the load test (``tests/e2e/test_load.py``), the slow-device test
(``tests/coordinator/test_slowness.py``) and the load benchmark (``bench/load.py``). The lab is
started the way a user would: ``fedshard coordinator``, three agents found by mDNS, ``fedshard
pair`` each, ``fedshard deploy`` under planning caps that force three segments. Every process is
stopped when the context ends.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from agent_helpers import AgentProc
from coordinator_helpers import (
    CoordinatorProc,
    pair_discovered,
    start_coordinator,
    stop_process,
    unpaired_agents,
    wait_for,
)

from coordinator.client import CoordinatorClient
from coordinator.errors import ApiError

MODEL_ID = "all-minilm-l6-v2"
CAPS = ("70MB", "30MB", "30MB")
"""Planning caps that force three segments: MiniLM's 90 MB of weights fit on no two devices."""
AGENT_MEMORY = "512MiB"
SENTENCES = (
    "A quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "How do I bake bread at home?",
    "The coordinator splits one network across the devices of a local network.",
    "Sharding here means runtime placement of tensors.",
    "Edge devices hand activations to each other over mutual TLS.",
    "It rained all day in the valley.",
    "Which train goes to the airport?",
)


@dataclass
class Lab:
    """A running coordinator and its three paired agents, with MiniLM deployed on them."""

    coordinator: CoordinatorProc
    agents: list[AgentProc]

    def pids(self) -> dict[str, int]:
        """Process id by role: ``coordinator`` and each agent's device name."""
        pids = {"coordinator": self.coordinator.proc.pid}
        pids.update({a.name: a.proc.pid for a in self.agents})
        return pids


@contextlib.contextmanager
def minilm_lab(tmp: Path, model: Path) -> Iterator[Lab]:
    """Start, pair and deploy; always stop every process."""
    suffix = secrets.token_hex(3)  # other runs on this host advertise agents too
    names = [f"ld{i}-{suffix}" for i in range(3)]
    coordinator = start_coordinator(tmp)
    try:
        with unpaired_agents(tmp, names, AGENT_MEMORY) as procs:
            lab = Lab(coordinator, procs)
            _pair(lab)
            args = ["deploy", str(model), "--name", MODEL_ID]
            for name, cap in zip(names, CAPS, strict=True):
                args += ["--memory-cap", f"{name}={cap}"]
            result = coordinator.cli(*args)
            if result.returncode != 0:
                raise RuntimeError(f"deploy failed:\n{result.stdout}{result.stderr}")
            yield lab
    finally:
        stop_process(coordinator.proc)


def _pair(lab: Lab) -> None:
    names = {a.name for a in lab.agents}
    pair_discovered(lab.coordinator, lab.agents, timeout=20)
    with lab.coordinator.api() as api:

        def paired() -> bool:
            return all(d.status == "paired" for d in api.devices() if d.name in names)

        if not wait_for(paired, 20):
            raise RuntimeError(f"agents not paired: {api.devices()}")


def embed(api: CoordinatorClient, text: str) -> str | None:
    """One ``/v1/embeddings`` request for one sentence: None when answered, else what went
    wrong (the status and detail of a refusal; status 0: no answer)."""
    try:
        api.embeddings(MODEL_ID, text)
    except ApiError as exc:
        return f"{exc.status}: {exc.detail}"
    return None


@dataclass
class LoadResult:
    """What a load run measured."""

    latencies_s: list[float]
    errors: list[str]
    seconds: float
    memory: dict[str, list[int]] = field(default_factory=dict)
    """Resident bytes by process, sampled after every ``sample_every`` requests."""

    @property
    def throughput(self) -> float:
        """Answered requests per second."""
        return len(self.latencies_s) / self.seconds if self.seconds > 0 else 0.0

    def growth(self, name: str) -> float:
        """Relative RSS growth of one process from the first sample to the last."""
        samples = self.memory[name]
        return samples[-1] / samples[0] - 1.0

    def percentile_ms(self, q: float) -> float:
        """The ``q``-th latency percentile in ms (nearest rank)."""
        ordered = sorted(self.latencies_s)
        rank = max(1, math.ceil(q / 100.0 * len(ordered)))
        return ordered[min(rank, len(ordered)) - 1] * 1e3


def run_load(
    lab: Lab,
    requests: int,
    clients: int,
    sample_every: int = 1000,
    deadline_s: float = math.inf,
    on_progress: Callable[[int], None] | None = None,
) -> LoadResult:
    """``requests`` single-sentence embeddings from ``clients`` threads, each with its own
    keep-alive client. Resident memory of every process is sampled when the ``sample_every``-th,
    ``2 * sample_every``-th, ... request completes (and after the last one)."""
    procs = {name: psutil.Process(pid) for name, pid in lab.pids().items()}
    result = LoadResult([], [], 0.0, {name: [] for name in procs})
    lock = threading.Lock()
    issued = [0]
    stop_at = time.monotonic() + deadline_s

    def sample() -> None:
        for name, proc in procs.items():
            result.memory[name].append(proc.memory_info().rss)

    def take() -> int | None:
        with lock:
            if issued[0] >= requests or time.monotonic() > stop_at:
                return None
            issued[0] += 1
            return issued[0]

    def client() -> None:
        with lab.coordinator.api(timeout=60.0) as api:
            while (n := take()) is not None:
                started = time.perf_counter()
                problem = embed(api, SENTENCES[n % len(SENTENCES)])
                took = time.perf_counter() - started
                with lock:
                    if problem is None:
                        result.latencies_s.append(took)
                    else:
                        result.errors.append(f"request {n}: {problem}")
                    done = len(result.latencies_s) + len(result.errors)
                    if done % sample_every == 0 or done == requests:
                        sample()
                if on_progress is not None:
                    on_progress(done)

    started = time.monotonic()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.seconds = time.monotonic() - started
    return result
