"""The ``fedshard.manifest/1`` document of a split: what each written segment holds and costs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx

from hostkit.files import file_sha256
from partitioner.analysis.decoding import segment_state, unit_state_bytes
from partitioner.analysis.modelio import initializer_bytes
from partitioner.analysis.phases import stage_prefill_s
from partitioner.cutting.inputs import Analysis
from partitioner.cutting.segment_files import WrittenSegment
from protocols.manifest import (
    DEFAULT_SESSIONS,
    Manifest,
    ModelInfo,
    SegmentEntry,
    SessionLimits,
    TensorInfo,
)
from protocols.plan import Plan
from protocols.problem import PlanningProblem


def build_manifest(
    model_path: Path,
    analysis: Analysis,
    plan: Plan,
    written: Sequence[WrittenSegment],
    sessions: SessionLimits = DEFAULT_SESSIONS,
    model_sha256: str | None = None,
    problem: PlanningProblem | None = None,
) -> Manifest:
    """The ``fedshard.manifest/1`` document for written segments of a plan (``model_sha256``:
    the model file's hash, if already known).

    Predicted memory and compute are the plan's per-stage numbers (memory with the runtime's
    overhead and arena when the problem was built with a runtime model); a decoder's stages
    also carry their prefill time when ``problem`` prices it.
    """
    types = {d.name: d.type for d in problem.devices} if problem else {}
    graph = analysis.model.graph
    declared = {v.name: v for v in [*graph.input, *graph.output]}
    layout = analysis.decoder
    state = [0] * len(analysis.units.units)
    if layout is not None:
        a = analysis
        state = unit_state_bytes(a.index, a.frontier, a.units, layout, sessions)
    segments = []
    for stage, seg in zip(plan.stages, written, strict=True):
        spec = seg.spec
        pairs = segment_state(spec.inputs, spec.outputs, layout) if layout else []
        segments.append(
            SegmentEntry(
                index=seg.spec.index,
                device=stage.device,
                file=seg.files[0].name,
                sha256=seg.sha256,
                inputs=list(seg.spec.inputs),
                outputs=list(seg.spec.outputs),
                param_bytes=seg.spec.param_bytes,
                predicted_memory_bytes=stage.memory_bytes,
                predicted_compute_s=stage.compute_s,
                predicted_prefill_s=(
                    stage_prefill_s(problem, types[stage.device], stage.start, stage.end)
                    if problem is not None and layout is not None
                    else None
                ),
                units=(stage.start, stage.end),
                state=pairs,
                state_bytes=sum(state[stage.start : stage.end]),
            )
        )
    return Manifest(
        model=ModelInfo(
            name=model_path.stem,
            sha256=model_sha256 or file_sha256(model_path),
            param_bytes=initializer_bytes(analysis.model),
            inputs=[_tensor_info(declared[n]) for n in analysis.index.inputs],
            outputs=[_tensor_info(declared[n]) for n in analysis.index.outputs],
        ),
        objective=plan.objective,
        bottleneck_s=plan.bottleneck_s,
        latency_s=plan.latency_s,
        segments=segments,
        sessions=sessions if layout else None,
    )


def _tensor_info(info: onnx.ValueInfoProto) -> TensorInfo:
    tt = info.type.tensor_type
    dtype = str(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)) if tt.elem_type else "unknown"
    shape: list[int | str | None] = [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
    ]
    return TensorInfo(name=info.name, dtype=dtype, shape=shape)
