"""The manifest of a deploy from a GGUF file, from its plan, unit table and built stages.

Segments chain by name as a split decoder's do (:mod:`partitioner.models.gguf.builder`), so the
model's inputs are the names some segment takes and none gives, its outputs the names some
segment gives and none takes, ordered as an export orders them (:func:`_io_order`).
"""

from __future__ import annotations

from pathlib import Path

from coordinator.deploy.gguf_plan import GgufUnits
from coordinator.deploy.gguf_stages import Built
from hostkit.files import file_sha256
from partitioner.analysis.phases import stage_prefill_s
from protocols.decoder import StatePair
from protocols.manifest import Manifest, ModelInfo, SegmentEntry, SessionLimits
from protocols.plan import Plan
from protocols.problem import PlanningProblem


def gguf_manifest(
    path: Path,
    plan: Plan,
    problem: PlanningProblem,
    table: GgufUnits,
    built: Built,
    sessions: SessionLimits,
) -> Manifest:
    """The manifest of a GGUF deploy: per stage its segment file, names, units, state and
    predicted memory and time; the model's outer inputs and outputs in the export's order."""
    types = {d.name: d.type for d in problem.devices}
    produced = {n for names in built.outputs for n in names}
    consumed = {n for names in built.inputs for n in names}
    model_inputs = sorted(consumed - produced, key=_io_order)
    model_outputs = sorted(produced - consumed, key=_io_order)
    segments = []
    for k, stage in enumerate(plan.stages):
        inputs = built.inputs[k]
        pairs = [
            StatePair(past=n, present="present" + n.removeprefix("past"))
            for n in inputs
            if n.startswith("past.")
        ]
        segments.append(
            SegmentEntry(
                index=k,
                device=stage.device,
                file=built.files[k].name,
                sha256=file_sha256(built.files[k]),
                inputs=inputs,
                outputs=built.outputs[k],
                param_bytes=built.param_bytes[k],
                predicted_memory_bytes=stage.memory_bytes,
                predicted_compute_s=stage.compute_s,
                predicted_prefill_s=stage_prefill_s(
                    problem, types[stage.device], stage.start, stage.end
                ),
                units=(stage.start, stage.end),
                state=pairs,
                state_bytes=sum(table.state_bytes[stage.start : stage.end]),
            )
        )
    return Manifest(
        model=ModelInfo(
            name=path.stem,
            sha256=file_sha256(path),
            param_bytes=sum(u.weight_bytes for u in table.units.units)
            + sum(s.nbytes for s in table.units.shared),
            inputs=[built.declared[n] for n in model_inputs],
            outputs=[built.declared[n] for n in model_outputs],
        ),
        objective=plan.objective,
        bottleneck_s=plan.bottleneck_s,
        latency_s=plan.latency_s,
        segments=segments,
        sessions=sessions,
    )


def _io_order(name: str) -> tuple[int, int, str]:
    """Model inputs and outputs in the export's order: ids, mask, positions, then per layer."""
    fixed = ["input_ids", "attention_mask", "position_ids", "top_logits", "top_ids"]
    if name in fixed:
        return (0, fixed.index(name), name)
    parts = name.split(".")
    if len(parts) == 3 and parts[1].isdigit():
        return (2, int(parts[1]), parts[2])
    return (1, 0, name)
