"""The planning units of a GGUF decoder, from its header alone (no graph, no weight read).

Units, in chain order: ``embedding`` (the token embedding's gather), ``blk.0`` ..
``blk.{L-1}`` (one per block), ``head`` (final norm and output head). A stage of units
``[u0, u1)`` is the builder's :class:`~partitioner.models.gguf.builder.SegmentRange`
(:func:`segment_range`). A tied embedding is two weights here, as in the segments: the
embedding unit holds its gather tables and the head unit its product's, each at the bytes ONNX
Runtime holds for that use (:func:`kernels.stored_bytes`), so no weight is shared between units.

Per unit: ``weight_bytes`` (resident, at the file's precision as mapped), ``file_bytes`` (the
GGUF bytes of its tensors), ``kv_bytes_per_token`` (float32 keys and values), ``out_bytes`` of
a decode step, and the roofline :class:`~protocols.problem.Work` of one decode step at a
context and of a prefill (FLOPs = 2 x multiply-adds, as :mod:`partitioner.analysis.costs`).
:func:`unit_plan` gives the :class:`~partitioner.analysis.units.UnitPlan` that
:func:`partitioner.planning.problem_from_graph.build_problem` takes, with the state bytes and
works beside it, so the planner and its cost model stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

from partitioner.analysis.units import GraphUnit, UnitPlan
from partitioner.models.gguf import kernels
from partitioner.models.gguf.archs import CHUNK_VALUES, row_chunks
from partitioner.models.gguf.builder import DEFAULT_TOP_K, SegmentRange
from partitioner.models.gguf.header import Architecture, GgufModel, TensorEntry
from partitioner.models.gguf.kernels import WeightsMode
from partitioner.models.gguf.kernels_codes import FLOAT_TYPES, default_zero_shift, layout
from protocols.decoder import TRAILING_POSITIONS
from protocols.problem import Work

OPS_BASE: dict[Architecture, int] = {
    Architecture.LLAMA: 90,
    Architecture.QWEN2: 87,
    Architecture.QWEN3: 96,
    Architecture.GEMMA3: 118,
    Architecture.PHI3: 83,
}
"""Operators (non-constant nodes) of a one-block segment the builder makes with F32 weights,
its mask and RoPE tables and its attention's two-row products included, the weights' row
padding not (checked in tests/partitioner/test_gguf_builder.py)."""
ROW_PAD_OPS = 5
"""Nodes a float weight's two-row product adds (:func:`.kernels_codes.two_row_matmul`:
Concat, Shape, Max and two Slice around the MatMul)."""
MIN_TERM_OPS = 9
"""Nodes a weight's min-term product adds (:func:`kernels.min_term`)."""
FLOAT_BYTES = 4
T = GGMLQuantizationType


@dataclass(frozen=True)
class GgufUnit:
    """One planning unit of a GGUF decoder."""

    name: str
    weight_bytes: int
    file_bytes: int
    kv_bytes_per_token: int
    out_bytes: int
    decode: Work
    prefill: Work


def tensor_stored_bytes(t: TensorEntry, weights: WeightsMode, *, embedding: bool = False) -> int:
    """Bytes ONNX Runtime holds for tensor ``t`` once mapped (vectors as float32)."""
    if len(t.shape) == 1:
        return FLOAT_BYTES * t.shape[0]
    n_out, n_in = t.shape
    return kernels.stored_bytes(t.type, n_out, n_in, weights, embedding=embedding)


def block_ops(model: GgufModel, matrices: list[TensorEntry], weights: WeightsMode) -> int:
    """Operators of a one-block segment: the architecture's base plus a ``Cast`` per F16/BF16
    weight, the row padding of each float weight's products and the min-term product's nodes per
    weight that needs one."""
    ops = OPS_BASE[model.architecture]
    for t in matrices:
        pieces = len(row_chunks(t.shape[0], t.shape[1], CHUNK_VALUES))
        ops += 0 if pieces == 1 else 2 * pieces  # a product per piece and a Concat (about)
        if weights != "keep" or t.type in FLOAT_TYPES:
            if weights == "keep":
                ops += ROW_PAD_OPS * pieces + (1 if t.type in (T.F16, T.BF16) else 0)
            continue
        lay = layout(t.type)
        if lay.has_low or default_zero_shift(lay, kernels.MATMUL_BITS[t.type]) is None:
            ops += MIN_TERM_OPS
    return ops


def _block(model: GgufModel, i: int, weights: WeightsMode, context: int, prompt: int) -> GgufUnit:
    tensors = model.layer_tensors(i)
    stored = sum(tensor_stored_bytes(t, weights) for t in tensors)
    matrices = [t for t in tensors if len(t.shape) == 2]
    macs = sum(t.elements for t in matrices)
    four_bit = sum(
        t.elements for t in matrices if kernels.MATMUL_BITS.get(t.type) == 4 and weights == "keep"
    )
    ops = block_ops(model, matrices, weights)
    kv = 2 * model.kv_heads * model.head_dim * FLOAT_BYTES
    attn = 2 * model.heads * model.head_dim  # multiply-adds per (query, key) pair: QK and PV
    # sliding layers mask instead of truncating: their products span the whole context too
    hidden_bytes = model.hidden * FLOAT_BYTES
    vector = 12 * model.hidden + 4 * model.ffn + 4 * model.heads * model.head_dim
    decode = Work(
        flops=2 * macs + 2 * attn * (context + 1) + vector + 3 * model.heads * (context + 1),
        bytes_read=stored + kv * context + 2 * hidden_bytes,
        ops=ops,
        gemv_flops=2 * four_bit,
        vector_flops=vector + 3 * model.heads * (context + 1),
    )
    pairs = prompt * prompt  # the graph scores every pair (masked ones too)
    prefill = Work(
        flops=2 * macs * prompt + 2 * attn * pairs + vector * prompt + 3 * model.heads * pairs,
        bytes_read=stored + kv * prompt + 2 * hidden_bytes * prompt,
        ops=ops,
        vector_flops=vector * prompt + 3 * model.heads * pairs,
    )
    return GgufUnit(
        name=f"blk.{i}",
        weight_bytes=stored,
        file_bytes=sum(t.n_bytes for t in tensors),
        kv_bytes_per_token=kv,
        out_bytes=hidden_bytes,
        decode=decode,
        prefill=prefill,
    )


def _embedding(model: GgufModel, weights: WeightsMode, prompt: int) -> GgufUnit:
    t = model.tensor("token_embd.weight")
    stored = tensor_stored_bytes(t, weights, embedding=True)
    row = -(-stored // model.vocab)
    pieces = len(row_chunks(model.vocab, model.hidden, CHUNK_VALUES))
    ops = 2 if pieces == 1 else 11 * pieces + 1  # per piece: select its ids, gather, zero
    scale = model.hidden if model.architecture == Architecture.GEMMA3 else 0
    return GgufUnit(
        name="embedding",
        weight_bytes=stored,
        file_bytes=t.n_bytes,
        kv_bytes_per_token=0,
        out_bytes=model.hidden * FLOAT_BYTES,
        decode=Work(flops=scale, bytes_read=row + model.hidden * FLOAT_BYTES, ops=ops),
        prefill=Work(
            flops=scale * prompt, bytes_read=(row + model.hidden * FLOAT_BYTES) * prompt, ops=ops
        ),
    )


def _head(model: GgufModel, weights: WeightsMode, top_k: int, prompt: int) -> GgufUnit:
    t = model.tensor(model.output_tensor)
    norm = model.tensor("output_norm.weight")
    stored = tensor_stored_bytes(t, weights) + tensor_stored_bytes(norm, weights)
    own = 0 if model.tied_embeddings else t.n_bytes
    macs = model.vocab * model.hidden
    rows = min(prompt, TRAILING_POSITIONS)
    four_bit = kernels.MATMUL_BITS.get(t.type) == 4 and weights == "keep"
    outputs = 2 * top_k * (FLOAT_BYTES + 8)
    return GgufUnit(
        name="head",
        weight_bytes=stored,
        file_bytes=own + norm.n_bytes,
        kv_bytes_per_token=0,
        out_bytes=outputs,
        decode=Work(
            flops=2 * macs + 4 * model.hidden,
            bytes_read=stored + model.hidden * FLOAT_BYTES + outputs,
            ops=12,
            topk_elements=model.vocab,
            gemv_flops=2 * macs if four_bit else 0,
            vector_flops=4 * model.hidden,
        ),
        prefill=Work(
            flops=2 * macs * rows + 4 * model.hidden * rows,
            bytes_read=stored + model.hidden * FLOAT_BYTES * prompt + outputs * rows,
            ops=12,
            topk_elements=model.vocab * rows,
            vector_flops=4 * model.hidden * rows,
        ),
    )


def unit_table(
    model: GgufModel,
    *,
    weights: WeightsMode = "keep",
    context: int = 512,
    prompt: int = 64,
    top_k: int = DEFAULT_TOP_K,
) -> list[GgufUnit]:
    """Every unit of ``model`` in chain order; decode work at ``context`` cached tokens,
    prefill work for a ``prompt``-token prompt."""
    blocks = [_block(model, i, weights, context, prompt) for i in range(model.layers)]
    return [_embedding(model, weights, prompt), *blocks, _head(model, weights, top_k, prompt)]


def unit_plan(table: list[GgufUnit], input_bytes: int = 3 * 8) -> UnitPlan:
    """The table as the planner's :class:`UnitPlan` (a unit's position range is its index)."""
    units = tuple(
        GraphUnit(
            name=u.name,
            start=k,
            end=k + 1,
            flops=u.decode.flops,
            weight_bytes=u.weight_bytes,
            out_bytes=u.out_bytes,
            workspace_bytes=0,
            initializers=frozenset(),
        )
        for k, u in enumerate(table)
    )
    return UnitPlan(
        units=units,
        boundaries=tuple(range(len(table) + 1)),
        input_bytes=input_bytes,
        shared=(),
    )


def state_bytes(table: list[GgufUnit], sessions: int, context: int) -> list[int]:
    """Per unit: the KV cache ``sessions`` sessions of ``context`` tokens keep (for
    ``build_problem``'s ``state_bytes``)."""
    return [u.kv_bytes_per_token * sessions * context for u in table]


def segment_range(model: GgufModel, start: int, end: int) -> SegmentRange:
    """The builder's range for the stage of units ``[start, end)``."""
    last = model.layers + 2
    return SegmentRange(
        start=max(start - 1, 0),
        end=min(end - 1, model.layers),
        first=start == 0,
        last=end == last,
    )
