"""Roofline costs of planning units: the FLOPs a unit does and the bytes it must read.

A unit's time on a device is the larger of its product FLOPs over the device's compute roof
and its bytes over the device's memory roof, plus its element-wise FLOPs and one-row 4-bit
products over their own roofs (``protocols.problem.roofline_s``; the cache roof applies when
the whole stage's bytes fit the cache). A decode step reads
hundreds of MB of weights for a few MFLOPs, so it is bound by memory, not by multiply-adds;
an encoder request at 128 tokens does ~100 FLOPs per weight byte and is bound by compute.

Bytes read, per unit, at the shapes the analysis bound (the deployment's shapes):

- **weights** at their stored precision: every initializer the unit's nodes read (shared ones
  included: a tied embedding is read by each unit that uses it), scales and zero points of
  quantized weights included, since they are initializers too; a table only *gathered* from
  (an embedding lookup, a 4-bit ``GatherBlockQuantized`` one
  included: its packed rows with their scales and zero points) counts the rows gathered, not
  the whole table;
- **activations** that cross the unit's boundary: every tensor its nodes read that was made
  outside it (the frontier coming in, model inputs; for a decoder the past keys and values, so
  the KV cache is counted at the costed context, bound with ``--dim``) and the frontier it
  hands on. Tensors made and used inside the unit are not counted: at the shapes an edge
  deployment runs they stay in the caches (measured on MiniLM at 1 x 128: counting every
  kernel's inputs and outputs priced the attention units at 5-6x their time).

Everything here is pure: graph index, frontier, shape table and units in, numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.analysis.costs import ShapeTable, is_vector_op, node_flops, tensor_proto_bytes
from partitioner.analysis.frontier import Frontier
from partitioner.analysis.graph import GraphIndex
from partitioner.analysis.units import StaticClosures, UnitPlan
from protocols.problem import Roofs, Work, roofline_s


@dataclass(frozen=True)
class UnitTraffic:
    """Where a unit's bytes come from (for tables and tests)."""

    weight_bytes: int
    activation_bytes: int
    ops: int
    """Operators the unit runs: its main nodes and the static ones it recomputes (shape
    arithmetic runs on every request when shapes are dynamic)."""
    topk_elements: int = 0
    """Elements its ``TopK`` nodes select from (a decoder's trailing candidates)."""

    @property
    def total(self) -> int:
        """All bytes the unit reads or writes."""
        return self.weight_bytes + self.activation_bytes


def unit_traffic(
    index: GraphIndex, frontier: Frontier, table: ShapeTable, units: UnitPlan
) -> list[UnitTraffic]:
    """Bytes each unit moves at ``table``'s binding (see the module docstring)."""
    sizes = {name: tensor_proto_bytes(t) for name, t in index.initializers.items()}
    closures = StaticClosures(index)
    out: list[UnitTraffic] = []
    for unit in units.units:
        nodes = frontier.order[unit.start : unit.end]
        gathered = _gathered_only(index, nodes, unit.initializers, table)
        weights = sum(sizes[name] for name in unit.initializers - gathered.keys())
        weights += sum(
            math.ceil(sizes[name] * share) if share is not None else table.nbytes(out)
            for name, (out, share) in gathered.items()
        )
        activations = _boundary_bytes(index, nodes, table, sizes) + unit.out_bytes
        ops = len(nodes) + len(closures.of(nodes))
        selected = sum(
            table.elements(index.node_inputs[n][0])
            for n in nodes
            if index.nodes[n].op_type == "TopK" and index.node_inputs[n]
        )
        out.append(UnitTraffic(weights, activations, ops, selected))
    return out


_GATHERS = frozenset({"Gather", "GatherElements", "GatherND"})
_BLOCK_GATHER = "GatherBlockQuantized"
_BLOCK_GATHER_TABLES = (0, 2, 3)
"""The inputs of a ``GatherBlockQuantized`` (ONNX Runtime's 4-bit embedding lookup) it reads
by rows: the packed data, its scales and its zero points."""


def _gathered_only(
    index: GraphIndex, nodes: Sequence[int], initializers: frozenset[str], table: ShapeTable
) -> dict[str, tuple[str, float | None]]:
    """Initializers the unit's nodes only gather rows from: name -> (the gather's output, the
    share of the initializer's rows it reads, or None where the output's size is what it reads).

    A float ``Gather`` reads as many bytes as it writes. A ``GatherBlockQuantized`` writes float
    rows but reads packed ones with their scales and zero points: each of those three is read
    in the share of its rows that the indices select (without this the int4 embedding of
    Qwen2.5-Coder-1.5B, 117 MB packed, counted whole in every decode step)."""
    gathered: dict[str, tuple[str, float | None]] = {}
    other: set[str] = set()
    for node_id in nodes:
        for position, name in enumerate(index.node_inputs[node_id]):
            if name not in initializers:
                continue
            read = _gather_read(index, node_id, position, table)
            if read is not None and name not in gathered:
                gathered[name] = read
            else:
                other.add(name)
    return {name: read for name, read in gathered.items() if name not in other}


def _gather_read(
    index: GraphIndex, node_id: int, position: int, table: ShapeTable
) -> tuple[str, float | None] | None:
    """How node ``node_id`` reads its input at ``position`` by rows, as in
    :func:`_gathered_only`'s values; None when it reads the whole input."""
    node = index.nodes[node_id]
    if node.op_type in _GATHERS and position == 0:
        return node.output[0], None
    if node.op_type != _BLOCK_GATHER or position not in _BLOCK_GATHER_TABLES:
        return None
    inputs = index.node_inputs[node_id]
    axis = int(next((a.i for a in node.attribute if a.name == "gather_axis"), 0))
    dims = index.initializers[inputs[position]].dims
    rows = table.elements(inputs[1])
    if not dims or not 0 <= axis < len(dims) or dims[axis] <= 0 or rows <= 0:
        return None
    return node.output[0], min(1.0, rows / int(dims[axis]))


def _boundary_bytes(
    index: GraphIndex, nodes: Sequence[int], table: ShapeTable, weights: dict[str, int]
) -> int:
    """Bytes of the activations the unit's nodes read that none of them made."""
    made = {name for node_id in nodes for name in index.nodes[node_id].output if name}
    read = {
        name
        for node_id in nodes
        for name in index.node_inputs[node_id]
        if name not in weights and name not in made and not index.is_static_tensor(name)
    }
    return sum(table.nbytes(name) for name in read)


def unit_work(
    index: GraphIndex,
    frontier: Frontier,
    table: ShapeTable,
    units: UnitPlan,
    unit_flops: Sequence[int] | None = None,
) -> list[Work]:
    """Each unit's :class:`~protocols.problem.Work` at ``table``'s binding; ``unit_flops``:
    the units' FLOPs at that binding when it is not the one ``units`` were costed at (a
    prefill), else the units' own."""
    traffic = unit_traffic(index, frontier, table, units)
    flops = [u.flops for u in units.units] if unit_flops is None else list(unit_flops)
    out = []
    for unit, moved, total in zip(units.units, traffic, flops, strict=True):
        nodes = frontier.order[unit.start : unit.end]
        out.append(
            Work(
                flops=total,
                bytes_read=moved.total,
                ops=moved.ops,
                topk_elements=moved.topk_elements,
                gemv_flops=min(total, _gemv_flops(index, nodes, table)),
                vector_flops=min(total, _vector_flops(index, nodes, table)),
            )
        )
    return out


GEMV_ROWS = 4
"""A 4-bit product over at most this many rows runs at the device's ``gemv_gflops`` (a decode
step, or a speculative pass of a few tokens); over more (a prefill) at its ``gflops``."""


def _gemv_flops(index: GraphIndex, nodes: Sequence[int], table: ShapeTable) -> int:
    """FLOPs of the nodes' ``MatMulNBits`` over at most :data:`GEMV_ROWS` rows."""
    total = 0
    for node_id in nodes:
        node = index.nodes[node_id]
        inputs = index.node_inputs[node_id]
        if node.op_type != "MatMulNBits" or not inputs:
            continue
        dims = table.dims_of(inputs[0])
        rows = math.prod(dims[:-1]) if dims else 1
        if rows <= GEMV_ROWS:
            total += node_flops(node, inputs, table)
    return total


def _vector_flops(index: GraphIndex, nodes: Sequence[int], table: ShapeTable) -> int:
    """FLOPs of the nodes' element-wise operators
    (:func:`~partitioner.analysis.costs.is_vector_op`)."""
    return sum(
        node_flops(index.nodes[n], index.node_inputs[n], table)
        for n in nodes
        if is_vector_op(index.nodes[n].op_type)
    )


def scaled_work(work: Work, factor: float) -> Work:
    """``work`` priced ``factor`` times as long under any roofs (every count scaled)."""
    return Work(
        flops=round(work.flops * factor),
        bytes_read=round(work.bytes_read * factor),
        ops=round(work.ops * factor),
        topk_elements=round(work.topk_elements * factor),
        gemv_flops=round(work.gemv_flops * factor),
        vector_flops=round(work.vector_flops * factor),
    )


def stage_seconds(work: Sequence[Work], roofs: Roofs) -> float:
    """Seconds of a stage made of ``work``'s units under ``roofs``, added left to right as
    the planner adds them, then one segment run's cost."""
    stage_bytes = sum(item.bytes_read for item in work)
    total = 0.0
    for item in work:
        total += roofline_s(item, roofs, stage_bytes)
    return total + roofs.call_us / 1e6


def bound_by(work: Work, roofs: Roofs) -> str:
    """``"memory"`` or ``"compute"``: which roof limits ``work`` (for tables)."""
    if roofs.memory_gbps is None:
        return "compute"
    memory = work.bytes_read / (roofs.memory_gbps * 1e9)
    return "memory" if memory > roofs.compute_s(work) else "compute"
