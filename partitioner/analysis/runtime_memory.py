"""What ONNX Runtime on an edge agent really keeps resident for a segment, beyond its weights.

The agent (see :mod:`edge_agent.runtime.engine` for its session options and why) measures a
segment's resident memory after loading and a warm-up at the deployment's shapes, with freed heap
returned to the OS. That is, per segment:

- the weights (the planner's ``weight_bytes`` and shared weights);
- a fixed per-session overhead: the session, its graph and kernels, pre-packed weight padding
  (:data:`DEFAULT_RUNTIME_OVERHEAD_BYTES`);
- the CPU arena's share of the activation workspace. The arena keeps what the largest run
  needed, grown in doubling chunks from 1 MiB, and ORT's fused kernels need scratch beyond the
  tensors in the graph, so the arena holds a multiple of the graph's live-set estimate
  (:func:`partitioner.analysis.units.build_units`' ``workspace_bytes``):
  ``floor + factor * workspace`` with :data:`DEFAULT_ARENA_FLOOR_BYTES` and
  :data:`DEFAULT_WORKSPACE_FACTOR`.

Measured here (all-MiniLM-L6-v2 cut in three, ONNX Runtime 1.32, one intra-op thread, memory
pattern off, arena and pre-packing on; resident after load and warm-up minus before, fresh
process per segment):

=========  ===========  ===================  =====================  =====================
shape      live set     arena, segment 0     arena, segment 1       ``1 MiB + 3.5x``
=========  ===========  ===================  =====================  =====================
3 x 16     0.59 MB      2.35 MB              2.02 MB                3.1 MB
1 x 128    2.03 MB      7.4 MB               7.2 MB                 8.2 MB
8 x 128    16.3 MB      53.4 MB              53.1 MB                57.9 MB
1 x 512    30.1 MB      76.6 MB              73.5 MB                106 MB
=========  ===========  ===================  =====================  =====================

and after loading, before any run: weights + 1.40 MB (segment 0), weights + 1.19 MB (segments 1
and 2). The queue buffers the planner adds (``(in + out) x (1 + queue_depth)``) are frames
waiting in the agent's queues while it serves, which a warm-up does not hold: they are headroom
the measurement does not see.

The workspace scales with the shapes the costing is bound to, so split at the deployment's
shapes (``fedshard split --dim batch=1 --dim sequence=128``), not only at the sample's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from onnx import NodeProto, TensorProto

from partitioner.analysis.costs import tensor_proto_bytes
from partitioner.errors import GraphError

MIB = 1 << 20
DEFAULT_RUNTIME_OVERHEAD_BYTES = 3 * MIB // 2
"""Fixed resident memory of one ONNX Runtime session on the agent (measured 1.2-1.4 MB)."""
DEFAULT_ARENA_FLOOR_BYTES = MIB
"""The CPU arena's first chunk: held as soon as a segment has run once."""
DEFAULT_WORKSPACE_FACTOR = 3.5
"""Arena bytes held per byte of the graph's live-set estimate (measured 2.4-3.6)."""


@dataclass(frozen=True)
class RuntimeMemory:
    """The agent runtime's memory beyond weights and queued frames, per stage."""

    overhead_bytes: int = DEFAULT_RUNTIME_OVERHEAD_BYTES
    arena_floor_bytes: int = DEFAULT_ARENA_FLOOR_BYTES
    workspace_factor: float = DEFAULT_WORKSPACE_FACTOR

    def __post_init__(self) -> None:
        if self.overhead_bytes < 0 or self.arena_floor_bytes < 0 or self.workspace_factor < 0:
            raise GraphError("runtime memory parameters must be non-negative")

    def stage_bytes(self, workspace_bytes: int) -> int:
        """Runtime memory of a stage whose largest unit live set is ``workspace_bytes``.

        Monotone in ``workspace_bytes``, so charging it per unit as the planning problem's
        ``workspace_bytes`` (a stage adds its units' largest) charges it exactly once per stage.
        """
        arena = self.arena_floor_bytes + math.ceil(self.workspace_factor * workspace_bytes)
        return self.overhead_bytes + arena


WIDENED_ON_CPU = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16})
"""Weight types the CPU execution provider keeps as float32: it has few half-precision kernels,
so ONNX Runtime casts their inputs to float32 and folds the casts of weights into float32
copies at load (tiny-llama in float16: resident 2.2x its stored weights, as in float32)."""


def resident_weight_bytes(tensor: TensorProto) -> int:
    """Bytes a weight occupies once the agent's session is loaded.

    Its stored size (int4 and int8 weights with their scales and zero points stay packed:
    Gemma 3 270M in int4, cut in three: predicted 1.02x, 0.87x and 1.02x of measured),
    except half-precision weights, which are resident as float32 (:data:`WIDENED_ON_CPU`).
    """
    stored = tensor_proto_bytes(tensor)
    return 2 * stored if tensor.data_type in WIDENED_ON_CPU else stored


PACKED_SCALE_COPIES = 2
"""``MatMulNBits`` at ``accuracy_level`` 4 (int8 activations) pre-packs its weight with a copy of
its scales and one float sum per block beside it, and the scales initializer stays: resident
are the stored data plus three times the scales. Measured on an 8192 x 8192 weight in blocks of
32 (43.0 MB stored): 70.5 MB resident at level 4, 53.4 MB at level 0 (the ``+17 MB`` is two
copies of its 8.4 MB of scales)."""
INT8_ACTIVATION_LEVEL = 4


def packed_extra_bytes(
    nodes: Iterable[NodeProto], initializers: Mapping[str, TensorProto]
) -> dict[str, int]:
    """Bytes beyond their stored size that ONNX Runtime keeps for some weights once loaded, by
    initializer name: the scales of every ``MatMulNBits`` that multiplies int8 activations
    (:data:`PACKED_SCALE_COPIES`)."""
    extra: dict[str, int] = {}
    for node in nodes:
        if node.op_type != "MatMulNBits" or len(node.input) < 3:
            continue
        level = next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)
        scales = initializers.get(node.input[2])
        if level >= INT8_ACTIVATION_LEVEL and scales is not None:
            extra[node.input[2]] = PACKED_SCALE_COPIES * tensor_proto_bytes(scales)
    return extra


GRAPH_ONLY = RuntimeMemory(overhead_bytes=0, arena_floor_bytes=0, workspace_factor=1.0)
"""No runtime model: a stage's workspace is the graph's live-set estimate alone."""
