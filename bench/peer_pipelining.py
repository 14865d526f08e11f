"""A peer engine on the same split: MiniLM's three-segment cut on fedshard's agents against
PyTorch's own pipeline runtime (``torch.distributed.pipelining``), side by side in one run.

- fedshard: exactly what bench/pipeline.py runs (``fedshard split`` into three ONNX segments,
  three agent processes on 127.0.0.1, TLS data plane, ONNX Runtime).
- torch: ``torch.distributed.pipelining`` cannot run ONNX segments, so three ranks (processes)
  each hold the Hugging Face torch model's layers of one segment, cut at the same layer
  boundaries as the partitioner's plan (read from the segments' initializers); a ``PipelineStage``
  per rank, ``ScheduleGPipe`` without a loss (forward only), gloo over loopback. The process
  group is set up with a ``FileStore``: a ``TCPStore`` would listen on every interface.

Both: batch 1 x 128 tokens, one intra-op thread per process, the same requests. Latency: one
request at a time, from the first stage until the result is back where the request entered.
Throughput: fedshard with ``--in-flight`` requests in flight; torch with each ``--microbatches``
count per ``step`` (one request per microbatch). Each side is also compared with its own
slowest-stage bound and its own engine running the whole model in one process.

The agents and the ranks stay up for the whole run, and each of ``--rounds`` short rounds
measures fedshard, then torch, so that a busy machine slows both alike; the table shows medians.

    .venv/bin/python bench/peer_pipelining.py [--requests 48] [--latency-runs 10]
                                              [--in-flight 8] [--microbatches 8,24] [--rounds 6]

Writes bench/results/peer_pipelining.md, .json and .png.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import onnx  # noqa: E402
import pipeline  # noqa: E402
from _peer_ranks import PeerBenchError, TorchRanks  # noqa: E402
from report import plots  # noqa: E402
from report.headlines import Headline, write_headlines  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from protocols.manifest import Manifest  # noqa: E402

RESULTS = REPO / "bench" / "results"
LAYER = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.")


def layer_ranges(manifest: Manifest, seg_dir: Path) -> list[tuple[int, int]]:
    """Per segment, the ``[first, end)`` transformer layers whose weights it holds."""
    ranges = []
    for seg in manifest.segments:
        graph = onnx.load(str(seg_dir / seg.file), load_external_data=False).graph
        layers = sorted(
            {int(m.group(1)) for init in graph.initializer if (m := LAYER.search(init.name))}
        )
        if not layers or layers != list(range(layers[0], layers[-1] + 1)):
            raise PeerBenchError(f"segment {seg.index} holds layers {layers}: not a block")
        ranges.append((layers[0], layers[-1] + 1))
    if [r[0] for r in ranges] != [0] + [r[1] for r in ranges[:-1]]:
        raise PeerBenchError(f"segments cut inside a layer (layer ranges {ranges})")
    return ranges


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pipeline.add_arguments(parser)
    parser.add_argument(
        "--microbatches", default="8,24", help="torch: microbatches per step, one run each"
    )
    parser.add_argument(
        "--rounds", type=int, default=6, help="rounds of fedshard then torch (table: medians)"
    )
    # short rounds, many of them: on a shared machine the load changes from minute to minute
    parser.set_defaults(requests=48, latency_runs=10)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from _peer_torch import run_worker

        return run_worker(args.worker, args.rank)
    console = Console()
    rounds = []
    with (
        tempfile.TemporaryDirectory(prefix="fedshard-peer-") as tmp_name,
        pipeline.deployed(Path(tmp_name) / "fedshard") as deployment,
    ):
        ranges = layer_ranges(deployment.manifest, deployment.split_dir)
        console.log(f"fedshard agents up; starting torch ranks for layers {ranges}")
        with TorchRanks(Path(tmp_name) / "torch", ranges, deployment.model) as ranks:
            for i in range(max(1, args.rounds)):
                console.log(f"round {i + 1}: fedshard")
                fed = deployment.measure(args)
                console.log(f"round {i + 1}: torch.distributed.pipelining")
                rounds.append(measures(fed, torch_round(ranks, args)))
            output = np.load(Path(tmp_name) / "torch" / "output.npy", allow_pickle=False)
            info = ranks.info
        name = deployment.manifest.model.outputs[0].name
        expected = deployment.whole.run([name], deployment.feeds)[0]
    diff = (
        "max abs(output - whole ONNX model)",
        fed["max_diff"],
        float(np.abs(output - expected).max()),
    )
    report(console, rounds, diff, ranges, info, args)
    return 0


def torch_round(ranks: TorchRanks, args: argparse.Namespace) -> dict[str, Any]:
    """One round on the torch ranks: whole model, latency, throughput per microbatch count."""
    return {
        "whole": ranks.command("whole", n=args.latency_runs),
        "latency": ranks.command("latency", n=args.latency_runs),
        "throughput": [
            ranks.command("throughput", n=args.requests, m=int(m))
            for m in args.microbatches.split(",")
        ],
    }


Rows = list[tuple[str, float, float]]


def measures(fed: dict[str, Any], peer: dict[str, Any]) -> Rows:
    """(measure, fedshard, torch) of one round."""
    whole, latency = peer["whole"], peer["latency"]
    fed_bound = 1e3 / max(fed["stage_ms"])
    rows = [
        ("whole model in one process, median ms", whole["ort_ms"], whole["torch_ms"]),
        (
            "one request at a time through 3 stages, median ms",
            fed["shard_ms"],
            latency["latency_ms"],
        ),
        (
            "  / whole model, same engine and round",
            fed["shard_ms"] / fed["whole_ms"],
            latency["latency_ms"] / whole["torch_ms"],
        ),
        (
            "  sum of stage compute, one at a time, ms",
            sum(fed["sequential_ms"]),
            sum(latency["compute_ms"]),
        ),
    ]
    for run in peer["throughput"]:
        bound = 1e3 / max(run["compute_ms"])
        label = f"{fed['in_flight']} in flight vs {run['microbatches']} microbatches per step"
        rows += [
            (f"throughput, {label}, req/s", fed["rps"], run["rps"]),
            ("  slowest-stage bound, req/s", fed_bound, bound),
            ("  throughput / own bound", fed["rps"] / fed_bound, run["rps"] / bound),
        ]
    return rows


def median_rows(rounds: list[Rows]) -> Rows:
    """Cell by cell, the median over rounds."""
    return [
        (
            cells[0][0],
            statistics.median(c[1] for c in cells),
            statistics.median(c[2] for c in cells),
        )
        for cells in zip(*rounds, strict=True)
    ]


def ratio_of(rows: Rows, prefix: str) -> list[float]:
    """fedshard / torch of every row whose name starts with ``prefix``."""
    return [a / b for name, a, b in rows if name.startswith(prefix)]


def _fmt(value: float) -> str:
    return f"{value:.2e}" if abs(value) < 1e-2 else f"{value:.2f}"


def report(
    console: Console,
    rounds: list[Rows],
    diff: tuple[str, float, float],
    ranges: list[tuple[int, int]],
    info: dict[str, Any],
    args: argparse.Namespace,
) -> None:
    """Print the table and write the Markdown, JSON and PNG results."""
    rows = [*median_rows(rounds), diff]
    cells = [
        (name, _fmt(a), _fmt(b), f"{a / b:.2f}x" if b and not name.startswith("max abs") else "")
        for name, a, b in rows
    ]
    columns = ("measure", "fedshard (3 agents, ORT, TLS)", "torch pipelining (3 ranks, gloo)")
    table = Table(title="MiniLM 1x128, same three-way cut, 1 intra-op thread per process")
    for col in (*columns, "fedshard / torch"):
        table.add_column(col)
    for row in cells:
        table.add_row(*row)
    console.print(table)
    per_round = "; ".join(
        f"round {i + 1}: latency {ratio_of(r, 'one request')[0]:.2f}x, throughput "
        + ", ".join(f"{x:.2f}x" for x in ratio_of(r, "throughput,"))
        for i, r in enumerate(rounds)
    )
    lines = [
        "# Peer engine on the same split: torch.distributed.pipelining",
        "",
        *describe(ranges, info, args),
        "",
        "| " + " | ".join((*columns, "fedshard / torch")) + " |",
        "|---|---|---|---|",
        *[f"| {' | '.join(c)} |" for c in cells],
        "",
        f"fedshard / torch per round: {per_round}.",
        "",
        "Reading it: the *whole model* row compares the engines alone (ONNX Runtime with the "
        "agents' session options against torch eager, interleaved in one process, no pipeline); "
        "the */ whole model* and *own bound* rows compare the pipeline runtimes, each against its "
        "own engine measured in the same round. Each torch `step` fills and drains the pipeline, "
        "so more microbatches per step amortise the bubble; fedshard keeps requests flowing "
        "without steps. Three stage processes (plus fedshard's requester) share "
        f"{os.cpu_count()} cores, so a stage computes more slowly while the pipeline is full "
        "than one request at a time; the bounds use the slower, pipelined stage times.",
        "",
    ]
    if plot(rows, RESULTS / "peer_pipelining.png"):
        lines += ["![fedshard against torch pipelining](peer_pipelining.png)", ""]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "peer_pipelining.md").write_text("\n".join(lines))
    write_headlines("peer_pipelining", headlines(rows))
    console.print(f"wrote {RESULTS / 'peer_pipelining.md'}")


def describe(
    ranges: list[tuple[int, int]], info: dict[str, Any], args: argparse.Namespace
) -> list[str]:
    """The paragraph that says what ran, and how."""
    cut = ", ".join(
        f"stage {i}: {'embeddings + ' if i == 0 else ''}layers {a}-{b - 1}"
        for i, (a, b) in enumerate(ranges)
    )
    return [
        f"`.venv/bin/python bench/peer_pipelining.py --rounds {args.rounds}` — all-MiniLM-L6-v2, "
        f"batch 1 x 128 tokens, cut by `fedshard split` into three segments ({cut}). fedshard: "
        "three agent processes on 127.0.0.1 exactly as in bench/pipeline.py (ONNX Runtime, TLS "
        "data plane). torch: `torch.distributed.pipelining` cannot load ONNX segments, so three "
        "ranks hold the Hugging Face torch model's layers at the same boundaries (read from the "
        "segments' weights), one `PipelineStage` each, `ScheduleGPipe` forward only, gloo on "
        f"loopback (torch {info['torch']}, attention `{info['attention']}`). One intra-op "
        f"thread per process on both sides, {os.cpu_count()} cores. Both run side by side: the "
        "agents and the ranks stay up, and each round measures fedshard, then torch. Latency, "
        f"per round: {args.latency_runs} requests one at a time, until the result is back where "
        "the request entered (fedshard: the requester; torch: rank 0, which the last rank sends "
        f"it to). Throughput, per round: {args.requests} requests; fedshard keeps "
        f"{args.in_flight} in flight, torch runs them as steps of N microbatches of one request "
        "each. Stage compute is measured "
        "inside each stage (fedshard: the agents' metrics). The table shows the median over "
        f"{args.rounds} rounds.",
    ]


def _throughput(rows: Rows) -> tuple[str, float, float]:
    """The throughput row where torch did best (its best microbatch count)."""
    return max((r for r in rows if r[0].startswith("throughput,")), key=lambda r: r[2])


def headlines(rows: Rows) -> list[Headline]:
    """Latency and best throughput, fedshard / torch; the engines alone, ORT / torch."""
    by_name = {name: (a, b) for name, a, b in rows}
    whole = by_name["whole model in one process, median ms"]
    latency = by_name["one request at a time through 3 stages, median ms"]
    name, fed_rps, torch_rps = _throughput(rows)
    setting = name.removeprefix("throughput, ").removesuffix(", req/s")
    return [
        Headline("MiniLM latency, fedshard / torch pipelining", latency[0] / latency[1], "x"),
        Headline(
            f"MiniLM throughput, fedshard / torch pipelining ({setting})", fed_rps / torch_rps, "x"
        ),
        Headline(
            "whole-model latency, ONNX Runtime / torch eager (engines alone)",
            whole[0] / whole[1],
            "x",
        ),
    ]


def plot(rows: Rows, path: Path) -> bool:
    """Latency and throughput of both runtimes, whole-model latency for reference."""
    by_name = {name: (a, b) for name, a, b in rows}
    whole = by_name["whole model in one process, median ms"]
    latency = by_name["one request at a time through 3 stages, median ms"]
    name, fed_rps, torch_rps = _throughput(rows)
    setting = name.removeprefix("throughput, ").removesuffix(", req/s").replace(" vs ", "\nvs ")
    return plots.side_by_side(
        "MiniLM 1x128 on the same three-way cut (medians over rounds)",
        ["whole model, ms", "3 stages, one at a time, ms", f"throughput, req/s\n({setting})"],
        {
            "fedshard (ORT, TLS)": [whole[0], latency[0], fed_rps],
            "torch pipelining (gloo)": [whole[1], latency[1], torch_rps],
        },
        "ms or req/s",
        path,
    )


if __name__ == "__main__":
    sys.exit(main())
