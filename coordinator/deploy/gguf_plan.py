"""A GGUF decoder's planning units from its header alone, and the stages' block ranges.

The chain is ``embedding, block 0, ..., block L-1, head``: the embedding (``token_embd``) and
the head (final norm and output weight, the embedding again when tied: a shared weight,
counted in each stage that uses it) are units of their own, so a large vocabulary can sit on
another device than the blocks. Each unit's weight bytes are what ONNX Runtime holds once the
tensors are mapped (:func:`partitioner.models.gguf.kernels.stored_bytes`, scales and
pre-packing included), a block's state is its KV cache at the planned sessions and context,
and its work is one decode step's (and a 64-token prefill's) products, attention and bytes
read, priced by the roofline like an exported decoder's. Nothing is read but tensor infos.

This is the coordinator's adapter over the header until the builder room's own unit table
(``partitioner.models.gguf.units``) replaces it; the planner and cost model are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.analysis.phases import PREFILL_TOKENS
from partitioner.analysis.runtime_memory import RuntimeMemory
from partitioner.analysis.units import GraphUnit, SharedInitializer, UnitPlan
from partitioner.models.gguf.builder import DEFAULT_TOP_K, SegmentRange
from partitioner.models.gguf.header import GgufModel, TensorEntry
from partitioner.models.gguf.kernels import WeightsMode, stored_bytes
from partitioner.planning.problem_from_graph import build_problem
from protocols.decoder import TRAILING_POSITIONS
from protocols.devices import DeviceList
from protocols.manifest import SessionLimits
from protocols.plan import Plan
from protocols.problem import PlanningProblem, Work

EMBEDDING = "token_embd.weight"
FLOAT_BYTES = 4


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
    """The units of ``model`` (embedding, every block, head), from its header."""
    tied = model.tied_embeddings
    embedding = _weight_bytes(model.tensor(EMBEDDING), weights, embedding=True)
    head_tensors = [model.tensor("output_norm.weight")]
    if not tied:
        head_tensors.append(model.tensor("output.weight"))
    hidden_bytes = model.hidden * FLOAT_BYTES
    context = sessions.max_context
    kv_token = 2 * model.kv_heads * model.head_dim * FLOAT_BYTES
    units: list[GraphUnit] = [
        _unit(
            "embedding",
            0,
            set() if tied else {EMBEDDING},
            hidden_bytes,
            0,
            0 if tied else embedding,
        ),
    ]
    state = [0]
    work = [Work(flops=0, bytes_read=hidden_bytes, ops=1)]
    prefill = [Work(flops=0, bytes_read=hidden_bytes * PREFILL_TOKENS, ops=1)]
    for i in range(model.layers):
        tensors = model.layer_tensors(i)
        weight = sum(_weight_bytes(t, weights) for t in tensors)
        products = sum(t.elements for t in tensors if len(t.shape) == 2)
        attention = 2 * model.heads * model.head_dim * context
        workspace = FLOAT_BYTES * (2 * model.ffn + 4 * model.hidden + model.heads * context)
        units.append(
            _unit(
                f"block.{i}",
                i + 1,
                {t.name for t in tensors},
                hidden_bytes,
                workspace,
                weight,
                2 * (products + attention),
            )
        )
        state.append(kv_token * context * sessions.max_sessions)
        work.append(_work(2 * products, 2 * attention, weight + kv_token * context, model))
        prefill.append(
            _work(
                2 * products * PREFILL_TOKENS,
                2 * model.heads * model.head_dim * PREFILL_TOKENS**2,
                weight + kv_token * PREFILL_TOKENS,
                model,
                PREFILL_TOKENS,
            )
        )
    head_weight = sum(_weight_bytes(t, weights) for t in head_tensors)
    products = model.vocab * model.hidden * TRAILING_POSITIONS
    out = (TRAILING_POSITIONS + 1) * DEFAULT_TOP_K * (FLOAT_BYTES + 8)
    units.append(
        _unit(
            "head",
            model.layers + 1,
            {t.name for t in head_tensors},
            out,
            FLOAT_BYTES * model.vocab * TRAILING_POSITIONS,
            head_weight,
            2 * products,
        )
    )
    state.append(0)
    read = head_weight + (embedding if tied else 0)
    head_work = Work(
        flops=2 * products, bytes_read=read, ops=8, topk_elements=products // model.hidden
    )
    work.append(head_work)
    prefill.append(head_work)
    shared = (SharedInitializer(EMBEDDING, embedding, (0, model.layers + 1)),) if tied else ()
    boundaries = tuple(range(len(units) + 1))
    plan = UnitPlan(tuple(units), boundaries, input_bytes=8 * 3, shared=shared)
    return GgufUnits(plan, tuple(state), tuple(work), tuple(prefill))


def planning_problem(
    table: GgufUnits, devices: DeviceList, name: str, work_scales: Sequence[float] | None = None
) -> PlanningProblem:
    """The planning problem of placing ``table``'s units on ``devices`` (decode step, roofline
    where the devices announce memory roofs; ``work_scales`` as for an exported decoder)."""
    work = list(table.work)
    if work_scales is not None and len(work_scales) == len(work):
        from partitioner.analysis.roofline import scaled_work

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


def stage_ranges(plan: Plan, layers: int) -> list[SegmentRange]:
    """Each stage's block range: units ``[s, e)`` of the chain ``embedding, blocks, head``."""
    ranges = []
    for stage in plan.stages:
        start = min(max(stage.start - 1, 0), layers)
        end = min(max(stage.end - 1, 0), layers)
        ranges.append(SegmentRange(start, end, stage.start == 0, stage.end == layers + 2))
    return ranges


def _unit(
    name: str,
    position: int,
    tensors: set[str],
    out_bytes: int,
    workspace: int,
    weight: int,
    flops: int = 0,
) -> GraphUnit:
    return GraphUnit(
        name=name,
        start=position,
        end=position + 1,
        flops=flops,
        weight_bytes=weight,
        out_bytes=out_bytes,
        workspace_bytes=workspace,
        initializers=frozenset(tensors),
    )


def _work(products: int, attention: int, read: int, model: GgufModel, tokens: int = 1) -> Work:
    vector = tokens * (12 * model.hidden + 4 * model.ffn)
    return Work(
        flops=products + attention + vector,
        bytes_read=read,
        ops=40,
        gemv_flops=products if tokens == 1 else 0,
        vector_flops=vector,
    )


def _weight_bytes(t: TensorEntry, weights: WeightsMode, embedding: bool = False) -> int:
    if len(t.shape) != 2:
        return t.elements * FLOAT_BYTES
    n_out, n_in = t.shape
    return stored_bytes(t.type, n_out, n_in, weights, embedding=embedding)
