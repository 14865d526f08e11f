"""Soak under hostility: embeddings and generations from 16 clients while the LAN attacks.

A real ``fedshard coordinator`` and three agents (``--memory 512MiB`` each) on 127.0.0.1 serve
all-MiniLM-L6-v2 (planning caps of 120 MB per device, so it is cut in at least two segments)
and a decoder (``tiny-llama`` by default: a random 4-layer Llama, so the run fits two cores;
``--decoder gemma3-270m`` for real text). Sixteen client threads share the work: ``--embeddings``
one-sentence ``/v1/embeddings`` requests (default 10,000) and ``--generations`` greedy
``/v1/completions`` of ``--tokens`` tokens (default 500 of 16). Meanwhile:

- a rogue announces fakes over mDNS on 127.0.0.1 (one per paired name with a made-up
  fingerprint, one copying a paired device's fingerprint);
- a client drips a request into the API one byte a second, reconnecting when cut off;
- two clients flood 4 MiB bodies without a token;
- after a quarter of the work one agent is killed (SIGKILL) and started again 10 s later.

Clients behave like well-kept OpenAI clients (as ``fedshard demo --chaos``'s): on 429/503 they
wait ``Retry-After`` (at most 2 s) and send again, on a dropped connection they send again.
Every answer is checked: embeddings against the whole model in one local ONNX Runtime session
(cosine >= 0.999), text against a local greedy run (identical), both from
:mod:`devtools.reference`. Reported: answers correct, wrong and lost (targets 0), every refusal
by status, what the hostile clients were answered, and the resident memory of every process
over time against its budget (``bench/results/soak.png``).

    .venv/bin/python bench/soak.py [--embeddings 10000] [--generations 500] [--clients 16]

Writes bench/results/soak.md, soak.json and soak.png.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from _soak_hostile import MemoryLog, Seen, dripper, flooder, plot_memory, rogue_announcer, sampler  # noqa: E402
from agent_helpers import AgentProc, minilm_model, start_agent  # noqa: E402
from coordinator_helpers import CoordinatorProc, start_coordinator, stop_process  # noqa: E402
from load_lab import SENTENCES, _pair  # noqa: E402
from report.headlines import Headline, write_headlines  # noqa: E402
from report.machine import stamp  # noqa: E402

from devtools.demo.chaos import MAX_BACKOFF_S, MIN_COSINE, TEXTS, Tally  # noqa: E402
from devtools.reference import greedy_reference, unsharded_embeddings  # noqa: E402

CACHE = REPO / ".pytest_cache" / "d" / "fedshard-minilm"
EXPORTS = REPO / ".cache" / "fedshard" / "exports"
RESULTS = REPO / "bench" / "results"
MINILM = "all-minilm-l6-v2"
DECODER = "soak-decoder"
AGENT_MEMORY = 512 << 20
CAP = "120MB"
PROMPTS = (
    "The three most useful things a home network router does are",
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
)
REQUEST_DEADLINE_S = 300.0
RESTART_AFTER_S = 10.0


class Lab:
    """The coordinator and agents; an agent can be killed and started again on its state."""

    def __init__(self, tmp: Path, coordinator: CoordinatorProc, agents: list[AgentProc]) -> None:
        self.tmp, self.coordinator, self.agents = tmp, coordinator, agents
        self.lock = threading.Lock()

    def pids(self) -> dict[str, int]:
        with self.lock:
            pids = {"coordinator": self.coordinator.proc.pid}
            pids.update({a.name: a.proc.pid for a in self.agents if a.proc.poll() is None})
            return pids

    def kill_and_restart(self, name: str) -> None:
        with self.lock:
            index = next(i for i, a in enumerate(self.agents) if a.name == name)
            self.agents[index].proc.send_signal(signal.SIGKILL)
            self.agents[index].proc.wait(10)
        time.sleep(RESTART_AFTER_S)
        agent = start_agent(self.tmp, name, None, memory=f"{AGENT_MEMORY >> 20}MiB")
        with self.lock:
            self.agents[index] = agent


@contextlib.contextmanager
def start_lab(tmp: Path, minilm: Path, decoder: Path) -> Iterator[Lab]:
    """Start, pair and deploy both models; always stop every process."""
    names = [f"sk{i}-{random.randrange(16**6):06x}" for i in range(3)]
    coordinator = start_coordinator(tmp)
    lab = Lab(tmp, coordinator, [])
    try:
        for name in names:
            lab.agents.append(start_agent(tmp, name, None, memory=f"{AGENT_MEMORY >> 20}MiB"))
        _pair(lab)
        caps = [arg for n in names for arg in ("--memory-cap", f"{n}={CAP}")]
        _cli(coordinator, "deploy", str(minilm), "--name", MINILM, *caps)
        _cli(coordinator, "deploy", str(decoder / "model.onnx"), "--name", DECODER,
             "--tokenizer", str(decoder))  # fmt: skip
        yield lab
    finally:
        stop_process(coordinator.proc)
        for agent in lab.agents:
            stop_process(agent.proc)


def _cli(coordinator: CoordinatorProc, *args: str) -> None:
    result = coordinator.cli(*args)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} failed:\n{result.stdout}{result.stderr}")


def _decoder_export(name: str) -> Path:
    from partitioner.models.frontdoor import export_decoder

    out = EXPORTS / name
    if not (out / "decoder.json").is_file():
        export_decoder(name, out, cache_dir=REPO / ".cache" / "fedshard")
    return out


class Clients:
    """The work queue, the references and what the clients saw."""

    def __init__(self, url: str, token: str, work: list[tuple[str, str]], refs: Any) -> None:
        self.url, self.token = url, token
        self.work, self.next = work, 0
        self.vectors, self.texts = refs
        self.tally = Tally()
        self.lock = threading.Lock()
        self.done = 0

    def take(self) -> tuple[str, str] | None:
        with self.lock:
            if self.next >= len(self.work):
                return None
            self.next += 1
            return self.work[self.next - 1]

    def run(self, tokens: int) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=120, trust_env=False) as api:
            while (item := self.take()) is not None:
                self.tally.add(sent=1)
                ok = self._until_answered(api, item, tokens)
                self.tally.add(
                    **({"correct": 1} if ok else {"wrong": 1} if ok is False else {"lost": 1})
                )
                with self.lock:
                    self.done += 1

    def _until_answered(self, api: httpx.Client, item: tuple[str, str], tokens: int) -> bool | None:
        kind, text = item
        path = "/v1/embeddings" if kind == "embed" else "/v1/completions"
        body: dict[str, Any] = {"model": MINILM, "input": text}
        if kind == "generate":
            body = {"model": DECODER, "prompt": text, "max_tokens": tokens, "temperature": 0}
        deadline, attempt = time.monotonic() + REQUEST_DEADLINE_S, 0
        while time.monotonic() < deadline:
            if attempt:
                self.tally.add(resent=1)
            attempt += 1
            try:
                reply = api.post(path, json=body)
            except httpx.HTTPError as exc:
                self.tally.refused(f"{kind}: {type(exc).__name__}")
                time.sleep(0.2)
                continue
            if reply.status_code == 200:
                return self._check(kind, text, reply.json())
            self.tally.refused(f"{kind}: {reply.status_code}")
            if reply.status_code not in (429, 503):
                return False
            time.sleep(min(float(reply.headers.get("retry-after", 1)), MAX_BACKOFF_S))
        return None

    def _check(self, kind: str, text: str, reply: dict[str, Any]) -> bool:
        if kind == "embed":
            got = np.asarray(reply["data"][0]["embedding"], dtype=np.float32)
            want = self.vectors[text]
            cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
            return cosine >= MIN_COSINE
        return bool(reply["choices"][0]["text"] == self.texts[text])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embeddings", type=int, default=10_000)
    parser.add_argument("--generations", type=int, default=500)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--decoder", default="tiny-llama")
    args = parser.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    minilm, decoder = minilm_model(CACHE), _decoder_export(args.decoder)
    texts = sorted(set(TEXTS) | set(SENTENCES))
    refs = (
        unsharded_embeddings(minilm, texts),
        {p: greedy_reference(decoder, p, args.tokens)[0] for p in PROMPTS},
    )
    work = [("embed", texts[i % len(texts)]) for i in range(args.embeddings)]
    work += [("generate", PROMPTS[i % len(PROMPTS)]) for i in range(args.generations)]
    random.Random(0).shuffle(work)
    with tempfile.TemporaryDirectory() as tmp, start_lab(Path(tmp), minilm, decoder) as lab:
        outcome = soak(lab, work, refs, args)
    report(outcome, args)
    tally = outcome["clients"].tally
    return 0 if tally.wrong == tally.lost == 0 else 1


def soak(
    lab: Lab, work: list[tuple[str, str]], refs: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """Run the clients and the hostile threads; what happened."""
    coordinator = lab.coordinator
    with coordinator.client() as api:
        devices = [
            d for d in api.get("/v1/devices").json() if d["name"] in {a.name for a in lab.agents}
        ]
        version = next(m for m in api.get("/v1/deployments").json() if m["model_id"] == MINILM)
    active = next(v for v in version["versions"] if v["plan_version"] == version["active"])
    victim = active["segments"][0]["device"]
    clients = Clients(coordinator.url, coordinator.token, work, refs)
    stop, seen, memory = threading.Event(), Seen(), MemoryLog()
    port = int(coordinator.url.rsplit(":", 1)[1])
    fingerprint = next(d["fingerprint"] for d in devices if d["name"] == victim)
    hostile = [
        threading.Thread(
            target=rogue_announcer, args=([d["name"] for d in devices], fingerprint, stop, seen)
        ),
        threading.Thread(target=dripper, args=(port, stop, seen)),
        threading.Thread(target=flooder, args=(coordinator.url, "/v1/embeddings", stop, seen)),
        threading.Thread(target=flooder, args=(coordinator.url, "/v1/completions", stop, seen)),
        threading.Thread(target=sampler, args=(lab.pids, memory, stop)),
    ]
    for thread in hostile:
        thread.start()
    events: dict[str, float] = {}
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.clients) as pool:
        futures = [pool.submit(clients.run, args.tokens) for _ in range(args.clients)]
        while clients.done < len(work) // 4 and not all(f.done() for f in futures):
            time.sleep(0.5)
        events[f"kill {victim}"] = time.monotonic() - memory.started
        lab.kill_and_restart(victim)
        events[f"restart {victim}"] = time.monotonic() - memory.started
        for future in futures:
            future.result()
    wall = time.monotonic() - started
    ours = {a.name for a in lab.agents}
    with coordinator.client() as api:
        statuses = [
            (d["name"], d["fingerprint"][:12], d["status"], d["online"])
            for d in api.get("/v1/devices").json()
            if d["name"] in ours or d["name"].startswith("copy-")
        ]
        failover = api.get("/v1/failover").json()
    stop.set()
    for thread in hostile:
        thread.join(60)
    return {"clients": clients, "seen": seen, "memory": memory, "events": events, "wall": wall,
            "victim": victim, "statuses": statuses, "failover": failover,
            "agents": [a.name for a in lab.agents]}  # fmt: skip


def report(outcome: dict[str, Any], args: argparse.Namespace) -> None:
    """Write soak.md, soak.json and soak.png and print the Markdown."""
    tally, memory, agents = outcome["clients"].tally, outcome["memory"], outcome["agents"]
    budgets = {name: AGENT_MEMORY for name in agents}
    RESULTS.mkdir(parents=True, exist_ok=True)
    plotted = plot_memory(memory, budgets, outcome["events"], RESULTS / "soak.png")
    lines = [
        "# Soak under hostility",
        "",
        *stamp(REPO),
        "",
        f"`.venv/bin/python bench/soak.py --embeddings {args.embeddings} --generations "
        f"{args.generations} --tokens {args.tokens} --clients {args.clients} --decoder "
        f"{args.decoder}`: {outcome['wall']:.0f} s.",
        "",
        "| answers | count |",
        "|---|---|",
        f"| sent | {tally.sent} |",
        f"| correct | {tally.correct} |",
        f"| wrong (target 0) | {tally.wrong} |",
        f"| lost (target 0) | {tally.lost} |",
        f"| re-sent after a refusal or a dropped connection | {tally.resent} |",
        "",
        "| refusal the clients saw (then re-sent) | count |",
        "|---|---|",
        *[f"| {why} | {n} |" for why, n in sorted(tally.refusals.items())],
        "",
        "| what the hostile clients got | count |",
        "|---|---|",
        *[f"| {why} | {n} |" for why, n in sorted(outcome["seen"].counts.items())],
        "",
        f"Killed (SIGKILL) and restarted {RESTART_AFTER_S:.0f} s later: `{outcome['victim']}`. "
        f"Failover events: {len(outcome['failover'].get('events', []))}.",
        "",
        "| process | peak resident MiB | budget MiB |",
        "|---|---|---|",
        *[
            f"| {name} | {memory.peak(name) / (1 << 20):.0f} | "
            f"{budgets[name] >> 20 if name in budgets else '-'} |"
            for name in sorted(memory.samples)
        ],
        "",
        "Device list at the end, while the rogue still announces (name, fingerprint, status):",
        "",
        *[
            f"- `{n}` `{fp}...`: {s}, {'online' if o else 'offline'}"
            for n, fp, s, o in sorted(outcome["statuses"])
        ],
        "",
    ]
    if plotted:
        lines += ["![resident memory against budget](soak.png)", ""]
    (RESULTS / "soak.md").write_text("\n".join(lines))
    over = [n for n in agents if memory.peak(n) > AGENT_MEMORY]
    write_headlines(
        "soak",
        [
            Headline("answers lost or wrong", float(tally.lost + tally.wrong), "", "<= 0"),
            Headline("agents over their budget", float(len(over)), "", "<= 0"),
            Headline("answers correct", float(tally.correct), ""),
        ],
    )
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
