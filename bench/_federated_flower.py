"""The SecAgg+ rows of ``bench/federated.py``: the same LoRA plan and WordNet shares, through
real Flower (the product's federation, not new plumbing).

A ``flower-superlink`` with SuperNode authentication and three authenticated local SuperNodes
(:func:`coordinator.training.lora.target.local_lora_federation`), one per WordNet share, and
``flwr run`` of :mod:`coordinator.training.lora.server_app` with SecAgg+ over the adapter
updates (:func:`coordinator.training.lora.runner.start_lora_run`), followed through its record
(:func:`coordinator.training.lora.runner.follow`). Nothing is merged or rolled out.

Bytes on the wire (issue 39 item 6): :class:`WireMeter` reads the kernel's counters of every
TCP connection to the SuperLink's fleet port (``ss -tin``: ``bytes_sent`` and
``bytes_received`` of the SuperNodes' sockets, TCP payload: gRPC, HTTP/2 and TLS included, IP
and TCP headers not) every 0.1 s, and cuts them at each round the ServerApp records, so a
round's bytes are everything a SuperNode sent and received from the end of the round before
to the end of this one: every SecAgg+ stage, the instructions, heartbeats and pulls.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType

import numpy as np

from coordinator.training.lora.records import LoraRecord
from devtools.lora_lab import DOMAINS, LoraSetup
from protocols.lora import LoraPlan

POPULATION = len(DOMAINS)


@dataclass(frozen=True)
class FlowerRun:
    """What one real-Flower run measured (from the ServerApp's record)."""

    loss: list[float]
    """Held-out loss before round 1, then after each round (token-weighted over devices)."""
    round_s: list[float]
    upload_bytes: float
    """Mean per client per round: the adapter arrays the client reports (float32)."""
    masked_bytes: float
    """Per client per round: the SecAgg+-masked vector as Flower serializes it."""
    trained_bytes: float
    epsilon: list[float]
    """Per round: the largest device's cumulative epsilon (empty without DP)."""
    wire_up: float = 0.0
    """Per client per training round: bytes its SuperNode sent to the SuperLink (measured)."""
    wire_down: float = 0.0
    """Per client per training round: bytes its SuperNode received from the SuperLink."""
    wire_final_up: float = 0.0
    """Per client: bytes sent after the last training round (under DP the evaluate-only
    SecAgg+ round, the final evaluation; else the clear evaluation), to the run's end."""
    wire_idle_up: float = 0.0
    """Per client: bytes per second its SuperNode sent while idle, before the run."""


_CONN = re.compile(r"^\S+\s+\S+\s+(\S+)\s+(\S+)")
_COUNTER = re.compile(r"\b(bytes_sent|bytes_received):(\d+)")


def tcp_counters(port: int) -> dict[str, tuple[int, int]]:
    """(bytes sent, bytes received) of each established local TCP connection to ``port``, by
    its local address (``ss -tinH``: the kernel's tcp_info)."""
    out = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( dport = :{port} )"],
        capture_output=True, text=True, check=True, timeout=10,
    ).stdout  # fmt: skip
    counters: dict[str, tuple[int, int]] = {}
    local = None
    for line in out.splitlines():
        match = _CONN.match(line)
        if match and not line.startswith((" ", "\t")):
            local = match.group(1)
            continue
        if local is not None:
            found = dict(_COUNTER.findall(line))
            counters[local] = (int(found.get("bytes_sent", 0)), int(found.get("bytes_received", 0)))
            local = None
    return counters


@dataclass
class WireMeter:
    """Bytes through the SuperNodes' connections to the SuperLink's fleet ``port``, cut at each
    round the record at ``record_path`` adds (see the module doc)."""

    port: int
    record_path: Path
    interval_s: float = 0.1
    seen: dict[str, tuple[int, int]] = field(default_factory=dict)
    """The latest counters of every connection seen (a closed one keeps its last sample)."""
    cuts: list[tuple[int, int]] = field(default_factory=list)
    """Total (sent, received) when the meter started and at each recorded round."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def total(self) -> tuple[int, int]:
        """(sent, received) summed over every connection seen so far."""
        return (sum(s for s, _ in self.seen.values()), sum(r for _, r in self.seen.values()))

    def _sample(self) -> None:
        for conn, (sent, received) in tcp_counters(self.port).items():
            old = self.seen.get(conn, (0, 0))
            self.seen[conn] = (max(sent, old[0]), max(received, old[1]))

    def _rounds(self) -> int:
        try:
            record = LoraRecord.from_json(self.record_path.read_bytes())
        except (OSError, ValueError):
            return 0
        return len(record.rounds)

    def _run(self) -> None:
        recorded = 0
        while not self._stop.is_set():
            self._sample()
            now = self._rounds()
            while recorded < now:
                self.cuts.append(self.total())
                recorded += 1
            time.sleep(self.interval_s)
        self._sample()

    def idle(self, settle_s: float = 3.0, window_s: float = 10.0) -> tuple[float, float]:
        """Bytes per second the SuperNodes sent and received in all, while no run was going
        (heartbeats and message polls, whose share of a round grows with its length); the
        meter's first cut moves to the end of the window."""
        time.sleep(settle_s)
        (up0, down0), start = self.total(), time.monotonic()
        time.sleep(window_s)
        (up1, down1), seconds = self.total(), time.monotonic() - start
        self.cuts[0] = (up1, down1)
        return (up1 - up0) / seconds, (down1 - down0) / seconds

    def __enter__(self) -> WireMeter:
        self._sample()
        self.cuts.append(self.total())
        self._thread = threading.Thread(target=self._run, name="wire-meter", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def masked_vector_bytes(plan: LoraPlan) -> int:
    """Bytes of the masked vector a SecAgg+ client uploads for ``plan``'s adapters: Flower's
    ``secaggplus_mod`` quantizes, masks and sends each array as int64 (``ndarray_to_bytes``)."""
    from flwr.common import ndarray_to_bytes

    from partitioner.models.lora import initial_adapters

    arrays = initial_adapters(plan.adapters, plan.lora.rank, seed=0)
    return sum(len(ndarray_to_bytes(np.zeros(a.shape, np.int64))) for a in arrays)


def run_flower(
    setup: LoraSetup, work: Path, rounds: int, per_device: int, seed: int, model_id: str
) -> FlowerRun:
    """One SecAgg+ run of ``setup.plan`` (of decoder ``model_id``) on three local SuperNodes
    (see the module doc)."""
    from coordinator.training.lora.runner import LoraTarget, follow, stage_segments, start_lora_run
    from coordinator.training.lora.target import local_lora_federation
    from coordinator.trust.ca import CertificateAuthority
    from devtools.wordnet import write_shares
    from protocols.training import TrainingRunRequest

    dirs = write_shares(work / "data", DOMAINS, per_device=per_device)
    run_dir = work / "run"
    tokenizer = setup.version_dir / "tokenizer.json"
    segments = stage_segments(setup.version_dir, tokenizer, run_dir / "segments")
    target = LoraTarget(
        model_id=model_id, version_dir=setup.version_dir, model_file=Path("unused"),
        tokenizer_file=tokenizer, versions_root=work / "versions", population=POPULATION,
        data_dirs=tuple(dirs), budgets=tuple(1 << 30 for _ in dirs),
    )  # fmt: skip
    request = TrainingRunRequest(rounds=rounds, model=model_id, method="lora")
    federation = local_lora_federation(CertificateAuthority.open(work / "ca"))
    with (
        federation(run_dir, segments, target) as link,
        WireMeter(link.port, run_dir / "record.json") as meter,
    ):
        idle_up, _ = meter.idle()
        cfg, flower_run = start_lora_run(
            link, run_dir, setup.plan, request, POPULATION, 600.0, seed=seed
        )
        record = follow(
            link, Path(cfg.record_file), lambda _: None, 1800.0, lambda: False, flower_run
        )
        time.sleep(2 * meter.interval_s)  # the last cut
    run = measured(record, setup.plan, meter)
    return replace(run, wire_idle_up=idle_up / POPULATION)


def measured(record: LoraRecord, plan: LoraPlan, meter: WireMeter | None = None) -> FlowerRun:
    """The bench's numbers from a finished run's record (and its wire meter)."""
    loss = [float(r.held_out_loss or 0.0) for r in record.rounds]
    wire: dict[str, float] = {}
    rounds = len(record.rounds)
    if meter is not None and len(meter.cuts) > rounds:
        (up0, down0), (up1, down1) = meter.cuts[0], meter.cuts[rounds]
        per = float(POPULATION * rounds)
        wire = {
            "wire_up": (up1 - up0) / per,
            "wire_down": (down1 - down0) / per,
            "wire_final_up": (meter.total()[0] - up1) / POPULATION,
        }
    return FlowerRun(
        loss=[*loss, float(record.final_loss or 0.0)],
        round_s=[r.seconds for r in record.rounds],
        upload_bytes=float(np.mean([r.upload_bytes_per_client for r in record.rounds])),
        masked_bytes=float(masked_vector_bytes(plan)),
        trained_bytes=max(r.trained_shard_bytes for r in record.rounds),
        epsilon=[max(r.epsilon.values()) for r in record.rounds if r.epsilon],
        **wire,
    )
