"""What a stage's predicted time is made of, next to the stage timed the agent's way.

Cuts a model in two at a unit boundary, measures this machine's roofs the way an agent does
(``edge_agent.profile.membench``, one thread), and prints per stage: the roofline terms the planner
charges (bytes or FLOPs, ``ops x op_us`` with the operators counted per unit, ``TopK``, one
call), the operators the stage counts per unit against the nodes its segment really holds and
the kernels ONNX Runtime runs after graph optimisation, and the segment's median time at the
planned shapes (one thread, each run the smaller of wall and thread CPU time, as the agent's
warm-up). Every repetition measures the roofs again, so the ratio and its spread come from
the same minute. Nothing here is used by the planner.

    .venv/bin/python bench/_stage_breakdown.py .cache/fedshard/exports/tiny-llama/model.onnx \
        --cut-unit 6 --repeat 3
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import onnx

from edge_agent.config import RuntimeConfig
from edge_agent.profile import membench
from edge_agent.profile.vectorbench import measure_vector_gflops
from edge_agent.runtime.engine import session_options
from edge_agent.runtime.fixed_costs import median_run
from partitioner.analysis.modelio import load_model
from partitioner.analysis.roofline import stage_seconds, unit_traffic
from partitioner.analysis.units import StaticClosures
from partitioner.cutting.inputs import Analysis
from partitioner.cutting.segment_files import write_segments
from partitioner.cutting.split import analyse, analysis_work
from protocols.problem import Roofs


def _roofs(runtime: RuntimeConfig, gflops: float) -> Roofs:
    memory = membench.measure_memory(runtime)
    return Roofs(
        gflops=gflops,
        vector_gflops=measure_vector_gflops(runtime),
        memory_gbps=memory.memory_gbps,
        cache_bytes=memory.cache_bytes,
        cache_gbps=memory.cache_gbps,
        op_us=memory.op_us,
        call_us=memory.call_us,
        topk_ns=memory.topk_ns,
    )


def _kernels(path: Path, runtime: RuntimeConfig, scratch: Path) -> int:
    import onnxruntime as ort

    options = session_options(runtime)
    optimised = scratch / f"{path.stem}.optimised.onnx"
    options.optimized_model_filepath = str(optimised)
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return len(onnx.load(str(optimised), load_external_data=False).graph.node)


def _stage_row(
    analysis: Analysis, lo: int, hi: int, roofs: Roofs, segment: Path, measured_s: float
) -> str:
    work = analysis_work(analysis)[lo:hi]
    traffic = unit_traffic(analysis.index, analysis.frontier, analysis.table, analysis.units)
    ops = sum(w.ops for w in work)
    predicted = stage_seconds(work, roofs)
    op_part = ops * roofs.op_us
    topk_part = sum(w.topk_elements for w in work) * roofs.topk_ns / 1e3
    weights = sum(t.weight_bytes for t in traffic[lo:hi])
    nodes = len(onnx.load(str(segment), load_external_data=False).graph.node)
    closures = StaticClosures(analysis.index)
    units = analysis.units.units[lo:hi]
    order = analysis.frontier.order
    per_unit = sum(len(closures.of(order[u.start : u.end])) for u in units)
    once = len(closures.of(order[units[0].start : units[-1].end]))
    return (
        f"units [{lo},{hi}): predicted {predicted * 1e6:7.1f} us = roofs "
        f"{(predicted * 1e6 - op_part - topk_part - roofs.call_us):6.1f} + ops {ops} x "
        f"{roofs.op_us:.3f} = {op_part:6.1f} + topk {topk_part:6.1f} + call "
        f"{roofs.call_us:5.1f}; weights {weights} B; static ops per unit {per_unit}, "
        f"per stage {once}; segment nodes {nodes}; "
        f"measured {measured_s * 1e6:7.1f} us; predicted/measured {predicted / measured_s:.2f}"
    )


def main() -> None:
    """Parse arguments, cut, time and print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--cut-unit", type=int, required=True, help="first unit of stage 2")
    parser.add_argument("--gflops", type=float, default=130.0, help="compute roof to price at")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    runtime = RuntimeConfig()
    analysis = analyse(load_model(args.model))
    n = len(analysis.units.units)
    cut = analysis.units.boundaries[args.cut_unit]
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        written = write_segments(
            analysis, [0, cut, analysis.frontier.size], scratch, source_dir=args.model.parent
        )
        segments = [w.files[0] for w in written]
        kernels = [_kernels(s, runtime, scratch) for s in segments]
        print(f"kernels after ORT graph optimisation per stage: {kernels}")
        for _ in range(args.repeat):
            roofs = _roofs(runtime, args.gflops)
            print(roofs.model_dump_json())
            times = _time_chain(analysis, segments, runtime, args.runs)
            for (lo, hi), segment, measured in zip(
                [(0, args.cut_unit), (args.cut_unit, n)], segments, times, strict=True
            ):
                print(_stage_row(analysis, lo, hi, roofs, segment, measured))


def _time_chain(
    analysis: Analysis, segments: list[Path], runtime: RuntimeConfig, runs: int
) -> list[float]:
    import onnxruntime as ort

    values: dict[str, Any] = dict(analysis.samples)
    times = []
    for path in segments:
        session = ort.InferenceSession(
            str(path), session_options(runtime), providers=["CPUExecutionProvider"]
        )
        feeds = {i.name: values[i.name] for i in session.get_inputs()}
        outputs = session.run(None, feeds)
        values.update(zip([o.name for o in session.get_outputs()], outputs, strict=True))
        times.append(median_run(session, feeds, runs, runtime.intra_op_threads))
    return times


if __name__ == "__main__":
    main()
