"""Long soak under hostility: is the memory of every process flat?

A real ``fedshard coordinator`` (with the digits training target) and three agents
(``--memory 512MiB`` each) on 127.0.0.1 serve all-MiniLM-L6-v2 (planning caps of 120 MB per
device, so it is cut in at least two segments) and a decoder (``tiny-llama`` by default: a
random 4-layer Llama, so the run fits two cores). For ``--minutes`` (default 30) and then it
stops by itself:

- ``--clients`` (16) client threads send a mix of one-sentence ``/v1/embeddings`` and
  ``/v1/chat/completions`` of ``--tokens`` tokens (``--chat-share`` of the requests, default 0.3)
  through the typed client :class:`coordinator.client.CoordinatorClient`, each ``--think``
  seconds apart;
- a federated training run (``POST /v1/training/runs``: one round, SecAgg+, DP, three local
  SuperNodes) starts every ``--train-every`` seconds (default 240) once the last one ended;
- a rogue announces fakes over mDNS on 127.0.0.1 (one per paired name with a made-up
  fingerprint, one copying a paired device's fingerprint), a client drips a request into the API
  one byte a second, two clients flood 4 MiB bodies without a token;
- at ``--kill-at`` of the run (default 0.25) one agent is killed (SIGKILL) and started again 10 s
  later on its state.

Clients behave like well-kept OpenAI clients (as ``fedshard demo --chaos``'s): on 429/503 they
wait ``Retry-After`` (at most 2 s) and send again, on a dropped connection they send again.
Every answer is checked: embeddings against the whole model in one local ONNX Runtime session
(cosine >= 0.999), chat text against a local greedy run with the served chat template
(identical), both from :mod:`devtools.reference`.

Every process's resident memory is sampled every 2 s (and the sum over the coordinator's
children: the training runs' Flower processes). Growth after warm-up (``--warmup`` minutes,
counted from the restart for the restarted agent) compares the median of the last
``--window`` minutes with the median of the first ``--window`` minutes after warm-up
(``bench/_soak_memory.py``); the target is below 5 % for the coordinator and every agent.

    .venv/bin/python bench/soak.py --minutes 30          # the soak of record
    .venv/bin/python bench/soak.py --minutes 3 --out /tmp/soak-check   # a quick check

Writes ``OUT/soak.md``, ``soak.json`` (headlines), ``soak-memory.json`` (every sample, the
growth per process, the training runs) and ``soak.png``; ``OUT`` defaults to bench/results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from _soak_hostile import Seen, dripper, flooder, rogue_announcer  # noqa: E402
from _soak_memory import (  # noqa: E402
    CHILDREN,
    Growth,
    MemoryLog,
    judge,
    load_log,
    plot_memory,
    sampler,
)
from agent_helpers import AgentProc, minilm_model, start_agent  # noqa: E402
from coordinator_helpers import (  # noqa: E402
    CoordinatorProc,
    pairing_code,
    start_coordinator,
    stop_process,
    wait_for,
)
from load_lab import SENTENCES  # noqa: E402
from report.headlines import Headline, read_headlines, write_headlines  # noqa: E402
from report.machine import stamp  # noqa: E402

from coordinator.client import CoordinatorClient  # noqa: E402
from devtools.demo.chaos import MAX_BACKOFF_S, MIN_COSINE, TEXTS, Tally  # noqa: E402
from devtools.reference import greedy_chat_reference, unsharded_embeddings  # noqa: E402

CACHE = REPO / ".pytest_cache" / "d" / "fedshard-minilm"
EXPORTS = REPO / ".cache" / "fedshard" / "exports"
RESULTS = REPO / "bench" / "results"
MINILM = "all-minilm-l6-v2"
DECODER = "soak-decoder"
AGENT_MEMORY = 512 << 20
CAP = "120MB"
QUESTIONS = (
    "What are the three most useful things a home network router does?",
    "Tell me a story.",
    "What is the capital of France?",
    "Write a function that returns the n-th Fibonacci number.",
)
REQUEST_DEADLINE_S = 300.0
RESTART_AFTER_S = 10.0
TARGET_GROWTH = 0.05
TRAINING_BODY = {"rounds": 1, "secure_aggregation": True, "dp": True}
TRAINING_DEADLINE_S = 900.0


class Lab:
    """The coordinator and agents; an agent can be killed and started again on its state."""

    def __init__(self, tmp: Path, coordinator: CoordinatorProc, agents: list[AgentProc]) -> None:
        self.tmp, self.coordinator, self.agents = tmp, coordinator, agents
        self.api = coordinator.api()
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
    coordinator = start_coordinator(tmp, training=True)
    lab = Lab(tmp, coordinator, [])
    try:
        for name in names:
            lab.agents.append(start_agent(tmp, name, None, memory=f"{AGENT_MEMORY >> 20}MiB"))
        _pair(lab)
        caps = [arg for n in names for arg in ("--memory-cap", f"{n}={CAP}")]
        _cli(coordinator, "deploy", str(minilm), "--name", MINILM, *caps)
        _cli(
            coordinator,
            "deploy",
            str(decoder / "model.onnx"),
            "--name",
            DECODER,
            "--tokenizer",
            str(decoder),
        )
        yield lab
    finally:
        stop_process(coordinator.proc)
        for agent in lab.agents:
            stop_process(agent.proc)


def _pair(lab: Lab) -> None:
    """Approve every agent with the code in its log, through the typed client."""
    names = {a.name for a in lab.agents}
    if not wait_for(lambda: names <= {d.name for d in lab.api.devices()}, 30):
        raise RuntimeError(f"agents not discovered: {lab.api.devices()}")
    for agent in lab.agents:
        lab.api.approve(agent.name, pairing_code(agent))

    def paired() -> bool:
        return all(d.status == "paired" for d in lab.api.devices() if d.name in names)

    if not wait_for(paired, 30):
        raise RuntimeError(f"agents not paired: {lab.api.devices()}")


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
    """The clients' work until the deadline, the references and what the clients saw."""

    def __init__(self, api: CoordinatorClient, refs: Any, args: argparse.Namespace) -> None:
        self.api = api
        self.vectors, self.answers = refs
        self.texts, self.chat_share = sorted(self.vectors), args.chat_share
        self.tokens, self.think = args.tokens, args.think
        self.tally = Tally()
        self.by_kind: dict[str, int] = {"embed": 0, "chat": 0}
        self.lock = threading.Lock()

    def run(self, seed: int, stop: threading.Event) -> None:
        rng = random.Random(seed)
        while not stop.wait(self.think):
            if rng.random() < self.chat_share:
                item = ("chat", QUESTIONS[rng.randrange(len(QUESTIONS))])
            else:
                item = ("embed", self.texts[rng.randrange(len(self.texts))])
            self.tally.add(sent=1)
            ok = self._until_answered(item)
            self.tally.add(
                **({"correct": 1} if ok else {"wrong": 1} if ok is False else {"lost": 1})
            )
            with self.lock:
                self.by_kind[item[0]] += 1

    def _until_answered(self, item: tuple[str, str]) -> bool | None:
        kind, text = item
        path = "/v1/embeddings" if kind == "embed" else "/v1/chat/completions"
        body: dict[str, Any] = {"model": MINILM, "input": text}
        if kind == "chat":
            body = {
                "model": DECODER,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": self.tokens,
                "temperature": 0,
            }
        deadline, attempt = time.monotonic() + REQUEST_DEADLINE_S, 0
        while time.monotonic() < deadline:
            if attempt:
                self.tally.add(resent=1)
            attempt += 1
            try:
                reply = self.api.call("POST", path, body)
            except httpx.HTTPError as exc:
                self.tally.refused(f"{kind}: {type(exc).__name__}")
                time.sleep(0.2)
                continue
            if reply.status == 200:
                return self._check(kind, text, reply.body)
            self.tally.refused(f"{kind}: {reply.status}")
            if reply.status not in (429, 503):
                return False
            time.sleep(MAX_BACKOFF_S * random.random())
        return None

    def _check(self, kind: str, text: str, reply: dict[str, Any]) -> bool:
        if kind == "embed":
            got = np.asarray(reply["data"][0]["embedding"], dtype=np.float32)
            want = self.vectors[text]
            cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
            return cosine >= MIN_COSINE
        return bool(reply["choices"][0]["message"]["content"] == self.answers[text])


def trainer(
    api: CoordinatorClient,
    every_s: float,
    stop: threading.Event,
    log: MemoryLog,
    runs: list[dict[str, Any]],
) -> None:
    """Start a training run every ``every_s`` seconds (after the last one ended) until
    ``stop``; record each run's span and outcome in ``runs``."""
    while not stop.wait(every_s):
        started = log.now()
        try:
            reply = api.call("POST", "/v1/training/runs", TRAINING_BODY)
        except httpx.HTTPError as exc:
            runs.append({"start_s": started, "end_s": log.now(), "status": type(exc).__name__})
            continue
        if reply.status != 200:
            runs.append(
                {
                    "start_s": started,
                    "end_s": log.now(),
                    "status": f"refused {reply.status}: {reply.detail}",
                }
            )
            continue
        run_id = str(reply.body["run_id"])
        status: dict[str, Any] = {"status": "unknown"}
        deadline = time.monotonic() + TRAINING_DEADLINE_S
        while time.monotonic() < deadline and not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                status = api.call("GET", f"/v1/training/runs/{run_id}").body
            if status.get("status") in ("finished", "failed"):
                break
            stop.wait(2.0)
        runs.append(
            {
                "run_id": run_id,
                "start_s": started,
                "end_s": log.now(),
                "status": status.get("status")
                if status.get("status") != "running"
                else "still running when the soak ended",
                "error": status.get("error"),
                "rounds": len(status.get("rounds") or []),
            }
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--chat-share", type=float, default=0.3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument(
        "--think", type=float, default=0.2, help="seconds each client waits between requests"
    )
    parser.add_argument("--train-every", type=float, default=240.0)
    parser.add_argument("--kill-at", type=float, default=0.25)
    parser.add_argument(
        "--kill-every",
        type=float,
        default=0.0,
        help="minutes: kill and restart the same agent again and again (0: once)",
    )
    parser.add_argument("--warmup", type=float, default=5.0, help="minutes")
    parser.add_argument("--window", type=float, default=3.0, help="minutes")
    parser.add_argument("--flood-pause", type=float, default=0.2)
    parser.add_argument("--decoder", default="tiny-llama")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--reanalyse",
        type=Path,
        metavar="DIR",
        help="only judge a finished run's DIR/soak-memory.json again",
    )
    args = parser.parse_args()
    if args.reanalyse is not None:
        flat = reanalyse(args.reanalyse)
        print((args.reanalyse / "soak.md").read_text())
        return 0 if flat else 1
    # a short check run scales warm-up and window down with it
    args.warmup = min(args.warmup, args.minutes / 3)
    args.window = min(args.window, args.minutes / 8)
    CACHE.mkdir(parents=True, exist_ok=True)
    minilm, decoder = minilm_model(CACHE), _decoder_export(args.decoder)
    texts = sorted(set(TEXTS) | set(SENTENCES))
    refs = (
        unsharded_embeddings(minilm, texts),
        {q: greedy_chat_reference(decoder, q, args.tokens) for q in QUESTIONS},
    )
    with tempfile.TemporaryDirectory() as tmp, start_lab(Path(tmp), minilm, decoder) as lab:
        outcome = soak(lab, refs, args)
    flat = report(outcome, args)
    tally = outcome["clients"].tally
    return 0 if tally.wrong == tally.lost == 0 and flat else 1


def soak(lab: Lab, refs: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Run the clients, the trainer and the hostile threads for ``args.minutes``."""
    api = lab.api
    ours = {a.name for a in lab.agents}
    devices = [d for d in api.devices() if d.name in ours]
    deployments = api.expect("GET", "/v1/deployments")
    version = next(m for m in deployments if m["model_id"] == MINILM)
    active = next(v for v in version["versions"] if v["version"] == version["active"])
    victim = active["segments"][0]["device"]
    fingerprint = next(d.fingerprint for d in devices if d.name == victim)
    clients = Clients(api, refs, args)
    stop, seen, memory = threading.Event(), Seen(), MemoryLog()
    runs: list[dict[str, Any]] = []
    url = lab.coordinator.url
    port = int(url.rsplit(":", 1)[1])
    coordinator_pid = lab.coordinator.proc.pid
    background = [
        threading.Thread(
            target=rogue_announcer, args=([d.name for d in devices], fingerprint, stop, seen)
        ),
        threading.Thread(target=dripper, args=(port, stop, seen)),
        threading.Thread(
            target=flooder, args=(url, "/v1/embeddings", stop, seen, args.flood_pause)
        ),
        threading.Thread(
            target=flooder, args=(url, "/v1/chat/completions", stop, seen, args.flood_pause)
        ),
        threading.Thread(target=sampler, args=(lab.pids, memory, stop, 2.0, coordinator_pid)),
        threading.Thread(target=trainer, args=(api, args.train_every, stop, memory, runs)),
    ]
    for thread in background:
        thread.start()
    events: dict[str, float] = {}
    duration = args.minutes * 60
    with ThreadPoolExecutor(max_workers=args.clients) as pool:
        futures = [pool.submit(clients.run, seed, stop) for seed in range(args.clients)]
        at, count = duration * args.kill_at, 0
        while at < duration and not stop.is_set():
            stop.wait(max(0.0, at - memory.now()))
            count += 1
            suffix = f" #{count}" if args.kill_every else ""
            events[f"kill {victim}{suffix}"] = memory.now()
            lab.kill_and_restart(victim)
            events[f"restart {victim}{suffix}"] = memory.now()
            if not args.kill_every:
                break
            at += args.kill_every * 60
        stop.wait(max(0.0, duration - memory.now()))
        statuses = [
            (d.name, d.fingerprint[:12], d.status, d.online)
            for d in api.devices()
            if d.name in ours or d.name.startswith("copy-")
        ]
        failover = api.expect("GET", "/v1/failover")
        stop.set()
        for future in futures:
            future.result()
    wall = memory.now()
    for thread in background:
        thread.join(TRAINING_DEADLINE_S)
    return {
        "clients": clients,
        "seen": seen,
        "memory": memory,
        "events": events,
        "wall": wall,
        "victim": victim,
        "statuses": statuses,
        "failover": failover,
        "runs": runs,
        "agents": [a.name for a in lab.agents],
    }


def report(outcome: dict[str, Any], args: argparse.Namespace) -> bool:
    """Write soak.md, soak.json, soak-memory.json and soak.png, print the Markdown; whether
    every process stayed within :data:`TARGET_GROWTH` once the re-plans had settled."""
    clients, memory, agents = outcome["clients"], outcome["memory"], outcome["agents"]
    tally, runs, victim = clients.tally, outcome["runs"], outcome["victim"]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    command = (
        f"`.venv/bin/python bench/soak.py --minutes {args.minutes:g} --clients {args.clients} "
        f"--chat-share {args.chat_share:g} --tokens {args.tokens} --think {args.think:g} "
        f"--train-every {args.train_every:g} --kill-at {args.kill_at:g} "
        f"{f'--kill-every {args.kill_every:g} ' if args.kill_every else ''}--warmup "
        f"{args.warmup:g} --window {args.window:g} --decoder {args.decoder}`"
    )
    lines = [
        "# Long soak under hostility: resident memory over time",
        "",
        *stamp(REPO),
        "",
        f"{command}: {outcome['wall'] / 60:.1f} minutes.",
        "",
        GROWTH_BEGIN,
        GROWTH_END,
        "",
        "| answers | count |",
        "|---|---|",
        f"| sent | {tally.sent} (embeddings {clients.by_kind['embed']}, chat "
        f"{clients.by_kind['chat']}) |",
        f"| correct | {tally.correct} |",
        f"| wrong (target 0) | {tally.wrong} |",
        f"| lost (target 0) | {tally.lost} |",
        f"| re-sent after a refusal or a dropped connection | {tally.resent} |",
        "",
        "| refusal the clients saw (then re-sent) | count |",
        "|---|---|",
        *[f"| {why} | {n} |" for why, n in sorted(tally.refusals.items())],
        "",
        "| training run | start min | minutes | status | rounds |",
        "|---|---|---|---|---|",
        *[
            f"| {r.get('run_id', '-')} | {r['start_s'] / 60:.1f} | "
            f"{(r['end_s'] - r['start_s']) / 60:.1f} | {r['status']}"
            f"{': ' + str(r['error']) if r.get('error') else ''} | {r.get('rounds', 0)} |"
            for r in runs
        ],
        "",
        "| what the hostile clients got | count |",
        "|---|---|",
        *[f"| {why} | {n} |" for why, n in sorted(outcome["seen"].counts.items())],
        "",
        "Killed (SIGKILL) at "
        + ", ".join(f"{at / 60:.1f}" for k, at in outcome["events"].items() if k.startswith("kill"))
        + f" min and restarted {RESTART_AFTER_S:.0f} s later each time: `{victim}`. "
        f"Failover events: {len(outcome['failover'].get('events', []))}.",
        "",
        "Device list at the end, while the rogue still announces (name, fingerprint, status):",
        "",
        *[
            f"- `{n}` `{fp}...`: {s}, {'online' if o else 'offline'}"
            for n, fp, s, o in sorted(outcome["statuses"])
        ],
        "",
        "![resident memory over time](soak.png)",
        "",
    ]
    (out / "soak.md").write_text("\n".join(lines))
    detail = {
        "format": "fedshard.soak-memory/1",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "wall_s": outcome["wall"],
        "events_s": outcome["events"],
        "victim": victim,
        "agents": agents,
        "training_runs": runs,
        "answers": {"sent": tally.sent, "correct": tally.correct, "wrong": tally.wrong,
                    "lost": tally.lost, "resent": tally.resent},
        "samples": {n: [[round(t, 1), rss] for t, rss in pts] for n, pts in memory.samples.items()},
    }  # fmt: skip
    (out / "soak-memory.json").write_text(json.dumps(detail) + "\n")
    flat = reanalyse(out)
    print((out / "soak.md").read_text())
    return flat


GROWTH_BEGIN, GROWTH_END = "<!-- growth -->", "<!-- /growth -->"


def reanalyse(out: Path) -> bool:
    """Judge the samples in ``out/soak-memory.json`` (:func:`_soak_memory.judge`), and write
    the growth section of ``out/soak.md``, the plot, the growth in the JSON and the headlines;
    whether every process stayed within :data:`TARGET_GROWTH` once the re-plans had settled.
    (``--reanalyse DIR`` runs only this, on a finished run's files.)"""
    memory, doc = load_log(out / "soak-memory.json")
    args, events = cast(dict[str, Any], doc["args"]), cast(dict[str, float], doc["events_s"])
    restart = max(
        ((name, at) for name, at in events.items() if name.startswith("restart ")),
        key=lambda item: item[1],
    )  # the last one: every process is judged after it
    victim, restart_s = restart[0].removeprefix("restart ").split(" #")[0], restart[1]
    agents = [n for n in memory.samples if n not in ("coordinator", CHILDREN)]
    budgets = dict.fromkeys(agents, AGENT_MEMORY)
    warmup_s, window_s = float(args["warmup"]) * 60, float(args["window"]) * 60
    judged = judge(memory, budgets, warmup_s, window_s, victim, restart_s, TARGET_GROWTH)
    runs = cast(list[dict[str, Any]], doc["training_runs"])
    spans = [(r["start_s"], r["end_s"]) for r in runs]
    plot_memory(memory, budgets, events, spans, warmup_s, out / "soak.png",
                settled_s=restart_s + warmup_s)  # fmt: skip
    text = (out / "soak.md").read_text()
    section = "\n".join([GROWTH_BEGIN, *judged.lines, GROWTH_END])
    if GROWTH_BEGIN in text:
        head, _, rest = text.partition(GROWTH_BEGIN)
        text = head + section + rest.partition(GROWTH_END)[2]
    else:  # a report written before the section had markers: from the verdict to the answers
        head, _, rest = text.partition("\n**")
        text = head + "\n" + section + "\n\n| answers |" + rest.partition("\n| answers |")[2]
    (out / "soak.md").write_text(text)
    doc["growth_settled"] = _growth_json(judged.settled)
    doc["growth_from_start"] = _growth_json(judged.from_start)
    doc.pop("growth", None)
    (out / "soak-memory.json").write_text(json.dumps(doc) + "\n")
    settled = [g.growth for g in judged.settled.values() if g is not None]
    answers = cast(dict[str, int], doc.get("answers") or {})
    headlines = [
        Headline("largest growth after warm-up", 100 * max(settled, default=float("nan")), "%",
                 f"< {100 * TARGET_GROWTH:g}"),
        Headline("agents over their budget",
                 float(sum(memory.peak(n) > AGENT_MEMORY for n in agents)), "", "<= 0"),
        Headline("training runs finished",
                 float(sum(r["status"] == "finished" for r in runs)), ""),
    ]  # fmt: skip
    if not answers and (out / "soak.json").is_file():  # a run written before they were kept
        headlines += [h for h in read_headlines(out / "soak.json") if h.name.startswith("answers")]
    if answers:
        headlines += [
            Headline("answers lost or wrong", float(answers["lost"] + answers["wrong"]), "",
                     "<= 0"),
            Headline("answers correct", float(answers["correct"]), ""),
        ]  # fmt: skip
    write_headlines("soak", headlines, out)
    return not judged.over


def _growth_json(grown: dict[str, Growth | None]) -> dict[str, Any]:
    return {
        n: None if g is None else {
            "since_s": g.since_s, "baseline_bytes": g.baseline, "final_bytes": g.final,
            "growth": g.growth, "peak_bytes": g.peak, "slope_mib_per_min": g.slope_mib_per_min,
        }
        for n, g in grown.items()
    }  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
