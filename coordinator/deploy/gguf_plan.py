"""A GGUF decoder's planning problem from its header alone, and the stages' block ranges.

The unit table is the builder room's (:mod:`partitioner.models.gguf.units`): ``embedding``,
one unit per block, ``head``; each unit's weight bytes at the precision ONNX Runtime holds
them in, a block's KV cache per token, and one decode step's (and a prefill's) roofline work.
Here it becomes the planner's problem, with the KV cache at the deployment's sessions and
context as each block's state, so the planner and its cost model are the ones every other
model is planned with. Nothing is read but tensor infos.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.analysis.phases import PREFILL_TOKENS
from partitioner.analysis.roofline import scaled_work
from partitioner.analysis.runtime_memory import RuntimeMemory
from partitioner.analysis.units import UnitPlan
from partitioner.models.gguf.builder import SegmentRange
from partitioner.models.gguf.header import GgufModel
from partitioner.models.gguf.kernels import WeightsMode
from partitioner.models.gguf.units import segment_range, state_bytes, unit_plan
from partitioner.models.gguf.units import unit_table as gguf_unit_table
from partitioner.planning.problem_from_graph import build_problem
from protocols.devices import DeviceList
from protocols.manifest import SessionLimits
from protocols.plan import Plan
from protocols.problem import PlanningProblem, Work


@dataclass(frozen=True)
class GgufUnits:
    """The chain of planning units of a GGUF decoder and what each costs."""

    units: UnitPlan
    state_bytes: tuple[int, ...]
    work: tuple[Work, ...]
    prefill: tuple[Work, ...]


def unit_table(
    model: GgufModel, sessions: SessionLimits, weights: WeightsMode = "keep"
) -> GgufUnits:
    """The units of ``model`` (embedding, every block, head), decode work at the planned
    context, state at the planned sessions."""
    context = sessions.max_context
    table = gguf_unit_table(model, weights=weights, context=context, prompt=PREFILL_TOKENS)
    return GgufUnits(
        units=unit_plan(table),
        state_bytes=tuple(state_bytes(table, sessions.max_sessions, context)),
        work=tuple(u.decode for u in table),
        prefill=tuple(u.prefill for u in table),
    )


def planning_problem(
    table: GgufUnits, devices: DeviceList, name: str, work_scales: Sequence[float] | None = None
) -> PlanningProblem:
    """The planning problem of placing ``table``'s units on ``devices`` (decode step, roofline
    where the devices announce memory roofs; ``work_scales`` as for an exported decoder)."""
    work = list(table.work)
    if work_scales is not None and len(work_scales) == len(work):
        work = [scaled_work(w, s) for w, s in zip(work, work_scales, strict=True)]
    return build_problem(
        table.units,
        devices,
        name=name,
        runtime=RuntimeMemory(),
        state_bytes=table.state_bytes,
        work=work,
        prefill=table.prefill,
        phase="decode",
    )


def stage_ranges(plan: Plan, model: GgufModel) -> list[SegmentRange]:
    """Each stage's block range: units ``[s, e)`` of the chain ``embedding, blocks, head``."""
    return [segment_range(model, stage.start, stage.end) for stage in plan.stages]
