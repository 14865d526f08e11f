"""A decoder's two phases: the decode step it is planned on and the prefill shown next to it.

A decoder's analysis is bound at its decode step (one new token against a past of the
sample's length): that is what every generated token costs, so throughput is planned on it.
The prompt is prefilled once per request, in one pass of :data:`PREFILL_TOKENS` tokens with
an empty past; it does far more multiply-adds per weight byte, so it is priced by the same
roofline at those shapes (:func:`prefill_work`) and shown next to the decode step
(:func:`stage_prefill_s`), never planned on.

Pure: the analysis's graph, shapes and units in, numbers out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import onnx

from partitioner.analysis.costs import node_flops
from partitioner.analysis.decoding import DecoderLayout
from partitioner.analysis.frontier import Frontier
from partitioner.analysis.graph import GraphIndex
from partitioner.analysis.roofline import stage_seconds, unit_work
from partitioner.analysis.shapes import infer_shapes
from partitioner.analysis.units import StaticClosures, UnitPlan
from protocols.problem import PlanningProblem, Work

PREFILL_TOKENS = 64
"""Prompt length the prefill is priced at."""


def prefill_binding(
    model: onnx.ModelProto,
    layout: DecoderLayout,
    samples: Mapping[str, Sequence[int]],
    tokens: int = PREFILL_TOKENS,
) -> dict[str, tuple[int, ...]]:
    """Input shapes of a prefill of ``tokens`` from the decode step's sample shapes.

    Every past's growing axis becomes 0; any other symbolic axis past the first (the batch)
    that the sample sizes as the new tokens or as past plus new tokens (the attention mask)
    becomes ``tokens``.
    """
    axis = {p.past: p.axis for p in layout.pairs}
    past = next((shape[axis[n]] for n, shape in samples.items() if n in axis), 0)
    step = _step_tokens(model, layout, samples)
    shapes: dict[str, tuple[int, ...]] = {}
    for graph_input in model.graph.input:
        shape = samples.get(graph_input.name)
        if shape is None:
            continue
        dims = graph_input.type.tensor_type.shape.dim
        new = list(shape)
        for k, size in enumerate(shape):
            symbolic = k < len(dims) and bool(dims[k].dim_param)
            if graph_input.name in axis and k == axis[graph_input.name]:
                new[k] = 0
            elif symbolic and k > 0 and size in {step, past + step}:
                new[k] = tokens
        shapes[graph_input.name] = tuple(new)
    return shapes


def _step_tokens(
    model: onnx.ModelProto, layout: DecoderLayout, samples: Mapping[str, Sequence[int]]
) -> int:
    """New tokens of the sample step: the last axis of the first non-state input."""
    for graph_input in model.graph.input:
        shape = samples.get(graph_input.name)
        if shape and graph_input.name not in layout.pasts:
            return int(shape[-1])
    return 1


def prefill_work(
    model: onnx.ModelProto,
    index: GraphIndex,
    frontier: Frontier,
    units: UnitPlan,
    layout: DecoderLayout,
    samples: Mapping[str, Sequence[int]],
) -> list[Work]:
    """Each unit's roofline work prefilling a :data:`PREFILL_TOKENS`-token prompt."""
    table = infer_shapes(model, index, {}, prefill_binding(model, layout, samples))
    closures = StaticClosures(index)
    flops = []
    for unit in units.units:
        nodes = frontier.order[unit.start : unit.end]
        every = [*nodes, *closures.of(nodes)]
        flops.append(sum(node_flops(index.nodes[n], index.node_inputs[n], table) for n in every))
    # the element-wise and 4-bit FLOPs are capped by the prefill's own FLOPs, not the decode
    # step's (which held tiny-llama's attention units at 4.5x too few element-wise FLOPs)
    return unit_work(index, frontier, table, units, flops)


def stage_prefill_s(problem: PlanningProblem, device_type: str, start: int, end: int) -> float:
    """Seconds a stage of units ``[start, end)`` takes to prefill on ``device_type`` (0 when
    the problem carries no prefill work or the type has no roofs)."""
    roofs = problem.type_roofs().get(device_type)
    units = problem.units[start:end]
    if roofs is None or any(u.prefill is None for u in units):
        return 0.0
    work = [unit.prefill for unit in units if unit.prefill is not None]
    return stage_seconds(work, roofs)
