"""MiniLM (batch 1, 128 tokens) over three agents vs the whole model in one ORT session.

Same run, same thread settings (1 intra-op thread everywhere):
- latency: one request at a time through the chain vs the whole model, interleaved; medians;
- throughput: 8 requests in flight; compared with the bound set by the slowest stage, whose
  compute time per request is what the agents measured (``/metrics``) during that phase.

    .venv/bin/python bench/pipeline.py [--requests 120] [--latency-runs 30]

Prints a table and writes bench/results/pipeline.md. Targets: sharded latency within 1.15x of
the whole model; pipelined throughput at least 80% of the slowest-stage bound. The split is
priced by the roofline on the roofs ``fedshard profile`` measures here (at 1 x 128), and the
table puts each stage's prediction next to the agents' measurements (target 0.75-1.33x), and
the sharded plan's latency and throughput next to the best single device (the whole model in
one session on this machine; target at least 0.95x).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import onnxruntime as ort  # noqa: E402
from agent_helpers import (  # noqa: E402
    AGENT_NAMES,
    MINILM_DEVICES,
    TestCA,
    agents,
    control_client,
    deploy_manifest,
    minilm_feeds,
    minilm_model,
    segment_inputs,
)
from report import plots  # noqa: E402
from report.headlines import Headline, write_headlines  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from devtools.requester import Requester  # noqa: E402
from edge_agent.config import RuntimeConfig  # noqa: E402
from edge_agent.profile.microbench import ComputeProfile, measure_profile  # noqa: E402
from edge_agent.runtime.engine import session_options  # noqa: E402
from protocols.manifest import Manifest  # noqa: E402

CACHE = REPO / ".pytest_cache" / "d" / "fedshard-minilm"


def compute_totals(text: str) -> tuple[float, float]:
    """(sum, count) of fedshard_compute_seconds from Prometheus text."""
    total = re.search(r"^fedshard_compute_seconds_sum (\S+)$", text, re.M)
    count = re.search(r"^fedshard_compute_seconds_count (\S+)$", text, re.M)
    assert total and count
    return float(total.group(1)), float(count.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name, deployed(Path(tmp_name)) as deployment:
        result = deployment.measure(args)
    report(result, deployment.manifest.segments)
    return 0


def roofline_split(model: Path, out: Path, profile: ComputeProfile) -> Manifest:
    """``fedshard split`` of MiniLM onto MINILM_DEVICES with this machine's measured roofs,
    costed at the benchmark's shapes (batch 1, 128 tokens), verified; the manifest."""
    from partitioner.cutting.inputs import SplitOptions
    from partitioner.cutting.split import split_model
    from protocols.devices import DeviceList

    # the measured roofs; one not measured is left out (the device's default)
    roofs = {k: v for k, v in profile.roofs().items() if v is not None}
    # MINILM_DEVICES' budgets plus 1 MB each for the workspace at 128 tokens
    spec = {
        "devices": [
            {**d, **roofs, "memory_bytes": int(d["memory_bytes"]) + 1_000_000}
            for d in MINILM_DEVICES["devices"]
        ]
    }
    options = SplitOptions(verify=True, dims={"batch": 1, "sequence": 128})
    return split_model(model, DeviceList.from_obj(spec), out, options).manifest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The measurement options (shared with bench/peer_pipelining.py)."""
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--latency-runs", type=int, default=30)
    parser.add_argument("--in-flight", type=int, default=8)


@dataclass
class Deployment:
    """MiniLM split three ways and deployed on three running agents, ready to measure."""

    manifest: Manifest
    split_dir: Path
    model: Path
    chain: list[Any]
    ca: TestCA
    client: Any
    ordered: list[Any]
    whole: Any
    local: list[tuple[Any, dict[str, np.ndarray]]]
    feeds: dict[str, np.ndarray]
    reports: list[dict[str, object]]

    def measure(self, args: argparse.Namespace) -> dict[str, Any]:
        """One measurement: interleaved latency runs, then pipelined throughput."""
        result: dict[str, Any] = asyncio.run(
            measure(  # type: ignore[no-untyped-call]
                self.chain,
                self.ca,
                self.whole,
                self.local,
                self.feeds,
                args,
                self.client,
                self.ordered,
            )
        )
        result["reports"] = self.reports
        return result


@contextlib.contextmanager
def deployed(tmp: Path) -> Iterator[Deployment]:
    """Split MiniLM into ``tmp/split`` and deploy it on three agents; stops them on exit."""
    CACHE.mkdir(parents=True, exist_ok=True)
    model = minilm_model(CACHE)
    feeds = minilm_feeds(1, 128)
    options = session_options(RuntimeConfig())
    whole = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    manifest = roofline_split(model, tmp / "split", measure_profile(RuntimeConfig()))
    warmups = segment_inputs(manifest, tmp / "split", feeds)
    ca = TestCA(tmp / "ca")
    with agents(tmp, AGENT_NAMES, ca, memory="512MiB", extra=["--no-advertise"]) as procs:
        by_name = {p.name: p for p in procs}
        with control_client(ca) as client:
            chain, reports = deploy_manifest(client, ca, by_name, manifest, tmp / "split", warmups)
            local = [
                (
                    ort.InferenceSession(
                        str(tmp / "split" / s.file), options, providers=["CPUExecutionProvider"]
                    ),
                    warm,
                )
                for s, warm in zip(manifest.segments, warmups, strict=True)
            ]
            yield Deployment(
                manifest=manifest,
                split_dir=tmp / "split",
                model=model,
                chain=chain,
                ca=ca,
                client=client,
                ordered=[by_name[s.device] for s in manifest.segments],
                whole=whole,
                local=local,
                feeds=feeds,
                reports=reports,
            )


async def measure(chain, ca, whole, local, feeds, args, client, ordered):  # type: ignore[no-untyped-def]
    requester = await Requester.connect(chain, ca.client_context("bench"), 1)
    try:
        expected = whole.run(["last_hidden_state"], feeds)[0]
        got = (await requester.infer(feeds))["last_hidden_state"]
        max_diff = float(np.abs(got - expected).max())
        for _ in range(3):
            whole.run(None, feeds)
            await requester.infer(feeds)
        whole_t, shard_t, local_t = [], [], []
        sequential_before = [compute_totals(client.get(p.url("/metrics")).text) for p in ordered]
        for _ in range(args.latency_runs):
            start = time.perf_counter()
            whole.run(["last_hidden_state"], feeds)
            whole_t.append(time.perf_counter() - start)
            start = time.perf_counter()
            await requester.infer(feeds)
            shard_t.append(time.perf_counter() - start)
            start = time.perf_counter()
            for session, inputs in local:
                session.run(None, inputs)
            local_t.append(time.perf_counter() - start)
        before = [compute_totals(client.get(p.url("/metrics")).text) for p in ordered]
        sequential = [
            (a[0] - b[0]) / (a[1] - b[1]) for a, b in zip(before, sequential_before, strict=True)
        ]
        gate = asyncio.Semaphore(args.in_flight)

        async def one() -> None:
            async with gate:
                await requester.infer(feeds)

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(args.requests)))
        elapsed = time.perf_counter() - start
        after = [compute_totals(client.get(p.url("/metrics")).text) for p in ordered]
    finally:
        await requester.close()
    stages = [(a[0] - b[0]) / (a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    return {
        "max_diff": max_diff,
        "whole_ms": statistics.median(whole_t) * 1e3,
        "shard_ms": statistics.median(shard_t) * 1e3,
        "shard_mean_ms": statistics.mean(shard_t) * 1e3,
        "local_ms": statistics.median(local_t) * 1e3,
        "rps": args.requests / elapsed,
        "stage_ms": [s * 1e3 for s in stages],
        "sequential_ms": [s * 1e3 for s in sequential],
        "requests": args.requests,
        "in_flight": args.in_flight,
        "latency_runs": args.latency_runs,
    }


def report(r, segments) -> None:  # type: ignore[no-untyped-def]
    bound = 1e3 / max(r["stage_ms"])
    latency_ratio = r["shard_ms"] / r["whole_ms"]
    throughput_ratio = r["rps"] / bound
    predicted = [s.predicted_compute_s * 1e3 for s in segments]
    warm = [float(rep["warmup_s"]) * 1e3 for rep in r["reports"]]
    band = [p / m for p, m in zip(predicted, warm, strict=True)]  # the agents' steady state
    single_rps = 1e3 / r["whole_ms"]
    never_slower_latency = r["whole_ms"] / r["shard_ms"]
    never_slower_throughput = r["rps"] / single_rps
    rows = [
        ("whole model, one ORT session (median)", f"{r['whole_ms']:.2f} ms", ""),
        ("three agents, one request at a time (median)", f"{r['shard_ms']:.2f} ms", ""),
        ("sharded / whole latency", f"{latency_ratio:.3f}x", "target <= 1.15x"),
        (
            "the three segments one after another in this process (median)",
            f"{r['local_ms']:.2f} ms",
            "what cutting the graph costs without processes and network",
        ),
        (
            "sum of mean stage compute, one request at a time (agents' metrics)",
            f"{sum(r['sequential_ms']):.2f} ms",
            " + ".join(f"{ms:.2f}" for ms in r["sequential_ms"])
            + f"; mean sharded latency {r['shard_mean_ms']:.2f} ms, so hand-offs and scheduling "
            f"take {r['shard_mean_ms'] - sum(r['sequential_ms']):.2f} ms",
        ),
        *[
            (
                f"stage {s.index} on {s.device}: compute per request while pipelined",
                f"{ms:.2f} ms",
                f"warm-up {float(rep['warmup_s']) * 1e3:.2f} ms, "
                f"resident {int(rep['measured_memory_bytes']) / 2**20:.0f} MiB "
                f"(predicted {s.predicted_memory_bytes / 2**20:.0f} MiB)",
            )
            for s, ms, rep in zip(segments, r["stage_ms"], r["reports"], strict=True)
        ],
        *[
            (
                f"stage {s.index}: predicted / measured (roofline)",
                f"{ratio:.2f}x",
                f"predicted {p:.2f} ms against the agent's warm-up median {w:.2f} ms (target "
                f"0.75-1.33x); {p / ms:.2f}x the pipelined wall time {ms:.2f} ms",
            )
            for s, p, w, ms, ratio in zip(
                segments, predicted, warm, r["stage_ms"], band, strict=True
            )
        ],
        ("slowest-stage bound", f"{bound:.1f} req/s", ""),
        (f"pipelined, {r['in_flight']} in flight", f"{r['rps']:.1f} req/s", ""),
        ("pipelined / bound", f"{throughput_ratio:.3f}", "target >= 0.80"),
        ("max abs(sharded - whole)", f"{r['max_diff']:.2e}", ""),
        (
            "best single device (whole model here), one at a time",
            f"{single_rps:.1f} req/s",
            "the plan must not be slower than this device alone",
        ),
        (
            "never slower: single-device latency / sharded latency",
            f"{never_slower_latency:.3f}x",
            "target >= 0.95x (MiniLM fits one device here; caps force three)",
        ),
        (
            "never slower: pipelined throughput / single device",
            f"{never_slower_throughput:.3f}x",
            "target >= 0.95x",
        ),
    ]
    table = Table(title="fedshard pipeline: MiniLM, batch 1, 128 tokens, 1 ORT thread per process")
    for col in ("measure", "value", "note"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    verdict = (
        f"latency target {'met' if latency_ratio <= 1.15 else 'NOT met'}; "
        f"throughput target {'met' if throughput_ratio >= 0.8 else 'NOT met'} "
        f"({os.cpu_count()} cores for 3 agents + requester)"
    )
    Console().print(table)
    Console().print(verdict)
    lines = [
        "# Pipeline: MiniLM over three agents",
        "",
        "`.venv/bin/python bench/pipeline.py` — all-MiniLM-L6-v2 exported by the partitioner's "
        "front door, cut by `fedshard split` (three segments), three agent processes on "
        "127.0.0.1 over TLS (requests go to the first agent, results come straight back from "
        f"the last), one ONNX Runtime thread per process, {os.cpu_count()} cores. "
        f"{r['latency_runs']} interleaved latency runs; {r['requests']} pipelined requests with "
        f"{r['in_flight']} in flight. Stage compute is what the agents measured in that phase.",
        "",
        "| measure | value | note |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
        verdict,
        "",
    ]
    out = REPO / "bench" / "results" / "pipeline.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    if plots.pipeline(r["stage_ms"], r["rps"], out.with_suffix(".png")):
        lines += ["![pipelined throughput against the stage bounds](pipeline.png)", ""]
    out.write_text("\n".join(lines))
    write_headlines(
        "pipeline",
        [
            Headline("MiniLM on 3 agents / whole model, latency", latency_ratio, "x", "<= 1.15"),
            Headline("pipelined throughput / slowest-stage bound", throughput_ratio, "", ">= 0.8"),
            Headline("pipelined throughput, MiniLM 1x128", r["rps"], "req/s"),
            Headline("worst stage predicted/measured (roofline)", max(band, key=_off), "x"),
            Headline("pipelined throughput / best single device", never_slower_throughput, "x"),
        ],
    )


def _off(ratio: float) -> float:
    """How far a predicted/measured ratio is from 1, either way."""
    return max(ratio, 1 / ratio)


if __name__ == "__main__":
    sys.exit(main())
