"""The report of ``bench/planner_lab.py``: tables, headlines and the plot."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab_helpers import LoadRun
from report import plots
from report.headlines import Headline, write_headlines
from report.machine import stamp

from devtools.demo.steps import PREDICTION_BAND as BAND
from protocols.devices import DeviceList
from protocols.plan import Plan

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("optimal", "even", "exo", "latency-optimal", "single")
"""``single``: the coordinator's plan with every device but the best single one capped to 0
(the best device alone: the never-slower reference)."""
"""The coordinator's plan (throughput objective), the two baselines, and its latency plan."""
TOKENS = 128
MB = 1000**2


@dataclass
class Outcome:
    """One deployment: its plan as predicted and what the lab measured."""

    strategy: str
    plan_version: int
    predicted: Plan
    """The deployed arrangement scored with the lab's links (equals the coordinator's plan)."""
    manifest_bottleneck_s: float
    manifest_latency_s: float
    sequential: LoadRun
    pipelined: LoadRun
    stages_sequential: list[dict[str, Any]]
    stages_pipelined: list[dict[str, Any]]
    deploy_s: float
    placements: list[dict[str, Any]]
    """The deployed version's segments (``GET /v1/deployments``): the coordinator's own
    predicted stage time, calibrated on what earlier deploys measured, and the agent's
    warm-up median."""


def median_ms(run: LoadRun) -> float:
    """Median latency of a run in ms (nan when nothing was answered)."""
    return statistics.median(run.latencies_s) * 1e3 if run.latencies_s else float("nan")


def _arrangement(plan: Plan) -> str:
    return " → ".join(f"{s.device}[{s.start},{s.end})" for s in plan.stages)


def _differs(outcome: Outcome, paper: Plan) -> str:
    """A note when the deployed version is not the plan on paper, or the coordinator's predicted
    bottleneck is not what the same arrangement scores with the lab's links."""
    notes = []
    if _arrangement(outcome.predicted) != _arrangement(paper):
        notes.append("≠ paper")
    if abs(outcome.manifest_bottleneck_s - outcome.predicted.bottleneck_s) > 1e-6:
        notes.append(f"coordinator predicted {outcome.manifest_bottleneck_s * 1e3:.1f} ms")
    return f" ({'; '.join(notes)})" if notes else ""


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def calibrated_bottleneck_s(plan: Plan, factor: float) -> float:
    """The plan's bottleneck with every stage's compute scaled by ``factor`` (links as is)."""
    stages = [max(s.compute_s * factor, s.transfer_s) for s in plan.stages]
    return float(max([plan.input_transfer_s, *stages]))


def planned_transfers_s(plan: Plan) -> float:
    """Every hand-off one request makes: in from the coordinator, between stages, and back."""
    return plan.input_transfer_s + sum(stage.transfer_s for stage in plan.stages)


def compute_factor(outcome: Outcome) -> float:
    """Measured over predicted compute, summed over the stages, one request at a time."""
    measured = sum(float(s.get("mean_compute_ms") or 0.0) for s in outcome.stages_sequential)
    predicted = sum(s.compute_s for s in outcome.predicted.stages) * 1e3
    return measured / predicted if predicted > 0 else float("nan")


def stage_rows(outcome: Outcome) -> list[list[str]]:
    """Per stage: predicted compute and transfer against the agents' measured means."""
    rows = []
    last = len(outcome.predicted.stages) - 1
    for k, stage in enumerate(outcome.predicted.stages):
        seq, pipe = outcome.stages_sequential[k], outcome.stages_pipelined[k]
        send = "result → coordinator" if k == last else "to next stage"
        rows.append(
            [
                outcome.strategy,
                f"{k}: {stage.device}[{stage.start},{stage.end})",
                f"{stage.compute_s * 1e3:.1f}",
                _ms(seq.get("mean_compute_ms")),
                _ms(pipe.get("mean_compute_ms")),
                f"{stage.transfer_s * 1e3:.1f}",
                _ms(seq.get("mean_send_ms")),
                _ms(pipe.get("mean_send_ms")),
                send,
            ]
        )
    return rows


def band_ratios(outcome: Outcome) -> list[float]:
    """The coordinator's predicted over the agent's warm-up stage time, per stage."""
    return [
        p["predicted_compute_s"] / p["warmup_s"] for p in outcome.placements if p["warmup_s"] > 0
    ]


def band_rows(outcome: Outcome) -> list[list[str]]:
    """Per stage: the coordinator's prediction against the agent's warm-up median and its
    mean compute one request at a time."""
    rows = []
    for p, seq in zip(outcome.placements, outcome.stages_sequential, strict=True):
        predicted, warm = p["predicted_compute_s"] * 1e3, p["warmup_s"] * 1e3
        mean = seq.get("mean_compute_ms")
        ratio = predicted / warm if warm > 0 else float("nan")
        inside = "yes" if BAND[0] <= ratio <= BAND[1] else "**no**"
        rows.append(
            [
                outcome.strategy,
                f"{p['index']}: {p['device']}",
                f"{predicted:.2f}",
                f"{warm:.2f}",
                f"{ratio:.2f}",
                inside,
                _ms(mean),
                "–" if not mean else f"{predicted / mean:.2f}",
            ]
        )
    return rows


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
        *["| " + " | ".join(row) + " |" for row in rows],
    ]


def _bound(plan: Plan) -> str:
    stage = max(plan.stages, key=lambda s: max(s.compute_s, s.transfer_s))
    if plan.input_transfer_s > max(stage.compute_s, stage.transfer_s):
        return f"{plan.stages[0].device} input link"
    what = "link" if stage.transfer_s > stage.compute_s else "compute"
    return f"{stage.device} {what}"


def paper_rows(paper: dict[str, Plan]) -> list[list[str]]:
    """The plans on paper, with ratios to the best of each objective."""
    best = paper["optimal"].bottleneck_s
    fastest = min(p.latency_s for p in paper.values())
    return [
        [
            name,
            _arrangement(p),
            f"{p.bottleneck_s * 1e3:.1f} ({_bound(p)})",
            f"×{p.bottleneck_s / best:.2f}",
            f"{p.latency_s * 1e3:.1f}",
            f"×{p.latency_s / fastest:.2f}",
            f"{p.input_transfer_s * 1e3:.1f} / {p.stages[-1].transfer_s * 1e3:.1f}",
        ]
        for name, p in paper.items()
    ]


def measured_rows(
    outcomes: list[Outcome], paper: dict[str, Plan], factor: float
) -> list[list[str]]:
    """Each deployment: predicted against measured throughput and latency."""
    rows = []
    for o in outcomes:
        calibrated = calibrated_bottleneck_s(o.predicted, factor)
        errors = len(o.sequential.errors) + len(o.pipelined.errors)
        compute = sum(float(s.get("mean_compute_ms") or 0.0) for s in o.stages_sequential)
        rows.append(
            [
                o.strategy,
                _arrangement(o.predicted) + _differs(o, paper[o.strategy]),
                f"{1 / o.predicted.bottleneck_s:.1f}",
                f"{1 / calibrated:.1f}",
                f"{o.pipelined.throughput:.1f}",
                f"{o.pipelined.throughput * o.predicted.bottleneck_s:.2f}",
                f"{o.predicted.latency_s * 1e3:.1f}",
                f"{median_ms(o.sequential):.1f}",
                f"{planned_transfers_s(o.predicted) * 1e3:.1f}",
                f"{median_ms(o.sequential) - compute:.1f}",
                str(errors),
                f"{o.deploy_s:.0f}",
            ]
        )
    return rows


MEASURED_HEADERS = [
    "split",
    "stages",
    "predicted req/s",
    "calibrated req/s",
    "measured req/s",
    "measured / predicted",
    "predicted latency ms",
    "measured latency ms (median)",
    "planned transfers ms",
    "latency − Σ stage compute ms",
    "errors",
    "deploy s",
]
STAGE_HEADERS = [
    "split",
    "stage",
    "compute predicted",
    "compute, 1 at a time",
    "compute, pipelined",
    "send predicted",
    "send, 1 at a time",
    "send, pipelined",
    "send",
]
BAND_HEADERS = [
    "split",
    "stage: device",
    "coordinator predicted ms",
    "agent warm-up ms",
    "predicted / warm-up",
    "in 0.75-1.33x",
    "compute, 1 at a time",
    "predicted / 1 at a time",
]
PAPER_HEADERS = [
    "plan",
    "stages (device[units))",
    "bottleneck ms (bound by)",
    "/ optimal",
    "latency ms",
    "/ fastest",
    "coordinator → first / last → coordinator ms",
]


def report(
    args: argparse.Namespace,
    links: list[dict[str, Any]],
    devices: DeviceList,
    paper: dict[str, Plan],
    outcomes: list[Outcome],
    wall_s: float,
) -> None:
    """Print and write planner_lab.md, .json and .png."""
    by = {o.strategy: o for o in outcomes}
    factor = compute_factor(by["optimal"])
    opt = by["optimal"].pipelined.throughput
    link_text = ", ".join(
        f"{link['a']}–{link['b']} {link['bandwidth_mbps']:.1f} Mbit/s" for link in links
    )
    if devices.requester is not None:
        link_text += "; from the coordinator: " + ", ".join(
            f"{link.device} {link.bandwidth_mbps:.1f} Mbit/s" for link in devices.requester.links
        )
    memory = ", ".join(f"{d.name} {d.memory_bytes / MB:.0f} MB" for d in devices.devices)
    lines = [
        "# Planner in the LAN lab: optimal against exo-style and even splits",
        "",
        "`.venv/bin/python bench/planner_lab.py` — a LAN lab of network namespaces on one bridge: "
        "`fedshard coordinator` in h0, one agent in each of h1, h2, h3 (found by mDNS, paired "
        f"with `fedshard pair`). h3's link is shaped to {args.slow_mbps:g} Mbit/s both ways "
        "(tbf); h1 and h2 are unshaped. Planning caps: " + memory + ". all-MiniLM-L6-v2 with "
        f"its sample inputs set to the bench's request (1 x {TOKENS} tokens), so the "
        "coordinator plans for that traffic. The coordinator measured the links once "
        f"({link_text}), then deployed the same model five ways through `POST "
        "/v1/deployments`: its own plan (throughput objective, the default), an even split and "
        "exo's memory-weighted split (the `baseline` field), its plan for the latency "
        "objective, and its plan with every device but the best single one capped to 0 (that "
        "device alone, the never-slower reference). A client inside h0 sends "
        "`/v1/embeddings` requests of that one text: "
        f"{args.latency_runs} one at a time (latency), then {args.requests} with "
        f"{args.in_flight} in flight (throughput). Per-stage times are the agents' own "
        "(`GET /v1/metrics`: mean compute and send time per request in each phase). "
        f"{os.cpu_count()} cores for the coordinator, three agents and the client. "
        f"Whole run {wall_s:.0f} s.",
        "",
        *stamp(REPO),
        "",
        "## On paper, with the lab's measured links",
        "",
        *_table(PAPER_HEADERS, paper_rows(paper)),
        "",
        "## Deployed and measured",
        "",
        "*predicted*: 1 / the plan's bottleneck. *calibrated*: the same with every stage's "
        f"compute scaled by ×{factor:.2f}, measured / predicted compute of the optimal plan one "
        "request at a time (the agents' GFLOP/s comes from a matrix-multiply microbenchmark), "
        "links as measured. Every plan counts the input's hand-off from the coordinator to the "
        "first stage and the result's from the last stage back (the last column of the table "
        "above), over the coordinator's measured links. Latency is what the client saw: it "
        "also includes the coordinator's own work (tokenizing, pooling), which no plan models; "
        "*latency − Σ stage compute* is the time spent outside the stages' compute.",
        "",
        *_table(MEASURED_HEADERS, measured_rows(outcomes, paper, factor)),
        "",
        "## Per stage: predicted against the agents' measurements (ms per request)",
        "",
        "An agent's send time is the time to hand a frame to its TCP socket. The kernel's send "
        "buffer takes a whole frame at once, so a slow link does not show there: it shows in "
        "the throughput (a link-bound plan runs at the link's pace) and in the latency.",
        "",
        *_table(STAGE_HEADERS, [row for o in outcomes for row in stage_rows(o)]),
        "",
        "## Per stage: the coordinator's prediction against the agent's warm-up (ms per request)",
        "",
        "The coordinator's own predicted stage time, as the console's Plan page and the demo's "
        "plan tables show it: the roofs the agent announced, scaled by the factors the "
        "coordinator fitted on what earlier deploys of this run measured (the first deploy has "
        "none). The agent's warm-up is the median of its timed runs of the segment at the "
        "deploy; *compute, 1 at a time* is its mean over the latency requests.",
        "",
        *_table(BAND_HEADERS, [row for o in outcomes for row in band_rows(o)]),
        "",
        f"even / optimal measured throughput ×{by['even'].pipelined.throughput / opt:.2f}, "
        f"exo / optimal ×{by['exo'].pipelined.throughput / opt:.2f}.",
        "",
        *never_slower(by),
    ]
    out = REPO / "bench" / "results" / "planner_lab.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    series: dict[str, Sequence[float]] = {
        "predicted": [1 / o.predicted.bottleneck_s for o in outcomes],
        "calibrated": [1 / calibrated_bottleneck_s(o.predicted, factor) for o in outcomes],
        "measured": [o.pipelined.throughput for o in outcomes],
    }
    title = f"MiniLM 1x{TOKENS} in the lab, h3 at {args.slow_mbps:g} Mbit/s"
    groups = [o.strategy for o in outcomes]
    if plots.side_by_side(title, groups, series, "requests / s", out.with_suffix(".png")):
        lines += ["![predicted and measured throughput per split](planner_lab.png)", ""]
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    write_headlines("planner_lab", headlines(outcomes, by))


def never_slower(by: dict[str, Outcome]) -> list[str]:
    """The chosen plan against the best single device alone, measured in the same run."""
    single = by.get("single")
    if single is None:
        return []
    opt = by["optimal"]
    throughput = opt.pipelined.throughput / single.pipelined.throughput
    latency = median_ms(single.sequential) / median_ms(opt.sequential)
    return [
        f"Never slower than the best single device ({_arrangement(single.predicted)} alone, "
        f"deployed and measured in this run): optimal / single measured throughput "
        f"×{throughput:.2f}, single / optimal latency ×{latency:.2f} (target ≥ 0.95).",
        "",
    ]


def headlines(outcomes: list[Outcome], by: dict[str, Outcome]) -> list[Headline]:
    """The numbers the report quotes."""
    opt = by["optimal"]
    rows = [
        Headline("lab: optimal plan measured throughput", opt.pipelined.throughput, "req/s"),
        Headline(
            "lab: even/optimal measured throughput",
            by["even"].pipelined.throughput / opt.pipelined.throughput,
            "x",
            "< 1",
        ),
        Headline(
            "lab: exo/optimal measured throughput",
            by["exo"].pipelined.throughput / opt.pipelined.throughput,
            "x",
            "< 1",
        ),
    ]
    for o in outcomes:
        rows.append(
            Headline(
                f"lab: predicted/measured bottleneck, {o.strategy} plan",
                o.predicted.bottleneck_s * o.pipelined.throughput,
                "x",
            )
        )
    if "latency-optimal" in by:
        fast = by["latency-optimal"]
        rows.append(
            Headline(
                "lab: predicted/measured latency, latency-optimal plan",
                fast.predicted.latency_s * 1e3 / median_ms(fast.sequential),
                "x",
            )
        )
    if "single" in by:
        rows.append(
            Headline(
                "lab: optimal/best single device measured throughput",
                opt.pipelined.throughput / by["single"].pipelined.throughput,
                "x",
                ">= 0.95",
            )
        )
    ratios = [r for o in outcomes for r in band_ratios(o)]
    if ratios:
        rows.append(
            Headline(
                "lab: stages predicted within 0.75-1.33x of their warm-up",
                sum(BAND[0] <= r <= BAND[1] for r in ratios) / len(ratios),
                "share",
                ">= 1",
            )
        )
    errors = sum(len(o.sequential.errors) + len(o.pipelined.errors) for o in outcomes)
    rows.append(Headline("lab: failed requests", errors, "", "<= 0"))
    return rows
