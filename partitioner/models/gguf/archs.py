"""Decoder layers of the five served architectures as ONNX nodes, one GGUF tensor at a time.

Semantics follow llama.cpp (``src/llama-model.cpp``); :mod:`.header` lists what differs per
architecture. Every op is plain ONNX (opset 17) except the weight products and the embedding
gather, which :mod:`.kernels` maps onto ONNX Runtime's kernels in the file's own quantization.

Shapes: the hidden state is ``[batch, q, hidden]``; a layer's queries ``[batch, q, heads,
head_dim]``, its keys and values ``[batch, kv_heads, total, head_dim]`` (the KV layout of
:mod:`protocols.decoder`). Query heads are grouped ``[batch, kv_heads, groups, q, head_dim]``
and keys only unsqueezed, so no key/value shape is ever read as a value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from gguf import GGMLQuantizationType
from onnx import TensorProto, helper, numpy_helper

from partitioner.models.gguf import kernels, kernels_codes
from partitioner.models.gguf.header import Architecture, GgufModel
from partitioner.models.gguf.kernels import GraphPart, WeightsMode
from partitioner.models.gguf.kernels_codes import int64_constant

RawTensors = Callable[[str], np.ndarray]
"""A tensor's raw data by name, as ``GGUFReader`` gives it (memory-mapped)."""
Release = Callable[[], None]
"""Called after each weight is mapped: lets the file's pages go (see :mod:`.reader`)."""
Sink = Callable[[TensorProto], TensorProto]
"""Takes each initializer as soon as it is made (e.g. writes it out) and returns what the graph
keeps of it."""
MASK_MIN = float(np.finfo(np.float32).min)
CHUNK_VALUES = 1 << 25
"""Values per piece of the embedding and output head (32 Mi): mapping a tensor holds a few
bytes per value for a moment (codes, packed copy, protobuf copy), so a 262k x 640 vocabulary
(Gemma 3) in one piece took about 500 MB above the process's base; in pieces about 100 MB."""
SWA_ROPE_BASE = 10000.0
"""llama.cpp's Gemma 3 sliding layers: RoPE base 10000, no scaling (whatever the file says)."""


@dataclass
class Emitter:
    """Collects nodes; every initializer goes through ``sink`` at once."""

    model: GgufModel
    raw: RawTensors
    sink: Sink
    weights: WeightsMode = "keep"
    accuracy_level: int = kernels.ACCURACY_LEVEL
    """``MatMulNBits``' accuracy level (0: float activations, for exactness checks)."""
    release: Release | None = None
    chunk_values: int = CHUNK_VALUES
    """The embedding and output head are mapped in row pieces of about this many values."""
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[TensorProto] = field(default_factory=list)
    _shared: dict[str, str] = field(default_factory=dict)

    def op(self, op_type: str, inputs: list[str], name: str, **attrs: object) -> str:
        """Append a node with one output named ``name``; returns it."""
        self.nodes.append(helper.make_node(op_type, inputs, [name], name, **attrs))  # type: ignore[arg-type]
        return name

    def ints(self, name: str, values: list[int]) -> str:
        """A small int64 constant (a Constant node, never external data)."""
        self.nodes.append(int64_constant(name, values))
        return name

    def floats(self, name: str, values: np.ndarray | float) -> str:
        """A small float32 constant (a Constant node)."""
        tensor = numpy_helper.from_array(np.asarray(values, np.float32), name)
        self.nodes.append(
            helper.make_node("Constant", [], [name], f"{name}/Constant", value=tensor)
        )
        return name

    def part(self, part: GraphPart) -> str:
        """Append a kernel's nodes; its initializers go to the sink."""
        self.nodes.extend(part.nodes)
        if self.release is not None:  # the file's pages first: the sink copies each tensor
            self.release()
        self.initializers.extend(self.sink(t) for t in part.initializers)
        return part.output

    def vector(self, tensor: str) -> str:
        """A 1-D F32 tensor (norm weight, bias) as an initializer named after it."""
        values = kernels.dequantize(self.raw(tensor), self._type(tensor), (self._len(tensor),))
        self.initializers.append(self.sink(numpy_helper.from_array(values, tensor)))
        return tensor

    def linear(self, tensor: str, x: str) -> str:
        """``x @ W.T`` for the GGUF weight ``tensor`` (``[n_out, n_in]``); a weight of more
        than :attr:`chunk_values` values is mapped in pieces of output rows, concatenated."""
        n_out, n_in = self.model.tensor(tensor).shape
        base = tensor.removesuffix(".weight")
        raw = self.raw(tensor)
        pieces = row_chunks(n_out, n_in, self.chunk_values)
        outs = []
        for k, (r0, r1) in enumerate(pieces):
            name = base if len(pieces) == 1 else f"{base}.{k}"
            part = kernels.matmul(
                name, x, raw[r0:r1], self._type(tensor), r1 - r0, n_in, self.weights,
                accuracy_level=self.accuracy_level,
            )  # fmt: skip
            outs.append(self.part(part))
        if len(outs) == 1:
            return outs[0]
        return self.op("Concat", outs, f"{base}/out", axis=-1)

    def shared(self, key: str, make: Callable[[], str]) -> str:
        """A tensor computed once per segment (masks, rotary tables)."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def _type(self, tensor: str) -> GGMLQuantizationType:
        return self.model.tensor(tensor).type

    def _len(self, tensor: str) -> int:
        return self.model.tensor(tensor).elements


def rms_norm(e: Emitter, x: str, weight: str, name: str) -> str:
    """``x / sqrt(mean(x^2) + eps) * w`` over the last axis (llama.cpp ``ggml_rms_norm``)."""
    sq = e.op("Mul", [x, x], f"{name}/sq")
    mean = e.op("ReduceMean", [sq], f"{name}/mean", axes=[-1], keepdims=1)
    eps = e.shared("eps", lambda: e.floats("const/eps", e.model.norm_eps))
    root = e.op("Sqrt", [e.op("Add", [mean, eps], f"{name}/add")], f"{name}/root")
    normed = e.op("Div", [x, root], f"{name}/normed")
    return e.op("Mul", [normed, e.vector(weight)], f"{name}/out")


def causal_mask(e: Emitter, window: int | None) -> str:
    """Additive mask ``[batch, 1, 1, q, total]`` from ``attention_mask`` and ``position_ids``:
    key slot ``j`` visible to the query at position ``p`` when ``j <= p``, its mask is 1 and,
    with a window, ``p - j < window``."""
    p = "mask" if window is None else f"mask_swa{window}"
    pos = e.op("Unsqueeze", ["position_ids", e.ints(f"{p}/ax2", [2])], f"{p}/pos")
    shape = e.op("Shape", ["attention_mask"], f"{p}/shape")
    total = e.op("Gather", [shape, e.ints(f"{p}/one", [1])], f"{p}/total_v")
    total = e.op("Squeeze", [total], f"{p}/total")
    zero = e.op("Squeeze", [e.ints(f"{p}/zero_v", [0])], f"{p}/zero")
    step = e.op("Squeeze", [e.ints(f"{p}/step_v", [1])], f"{p}/step")
    slots = e.op("Range", [zero, total, step], f"{p}/slots")
    allowed = e.op("LessOrEqual", [slots, pos], f"{p}/causal")
    seen = e.op("Cast", ["attention_mask"], f"{p}/seen", to=TensorProto.BOOL)
    seen = e.op("Unsqueeze", [seen, e.ints(f"{p}/ax1", [1])], f"{p}/seen_q")
    allowed = e.op("And", [allowed, seen], f"{p}/allowed")
    if window is not None:
        low = e.op("Sub", [pos, e.ints(f"{p}/window", [window])], f"{p}/low")
        inside = e.op("Greater", [slots, low], f"{p}/inside")
        allowed = e.op("And", [allowed, inside], f"{p}/allowed_swa")
    add = e.op(
        "Where", [allowed, e.floats(f"{p}/zero_f", 0.0), e.floats(f"{p}/min", MASK_MIN)], f"{p}/add"
    )
    return e.op("Unsqueeze", [add, e.ints(f"{p}/ax12", [1, 2])], f"{p}/out")


def rope_tables(e: Emitter, base: float, scale: float) -> tuple[str, str]:
    """``cos`` and ``sin`` ``[batch, q, 1, head_dim]`` for ``position_ids``, laid out for the
    file's RoPE (pairs: each angle twice in a row; neox: the angles twice end to end)."""
    m = e.model
    d = m.head_dim
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d) / scale
    if "rope_freqs.weight" in m.tensors:  # Llama 3.x: per-dimension factors divide the angles
        inv = inv / kernels.dequantize(
            e.raw("rope_freqs.weight"), m.tensor("rope_freqs.weight").type, (d // 2,)
        )
    p = f"rope{base:g}x{scale:g}"
    pos = e.op("Cast", ["position_ids"], f"{p}/pos", to=TensorProto.FLOAT)
    pos = e.op("Unsqueeze", [pos, e.ints(f"{p}/ax", [2])], f"{p}/pos3")
    angles = e.op("Mul", [pos, e.floats(f"{p}/inv", inv.astype(np.float32))], f"{p}/angles")
    if m.rope_layout == "neox":
        full = e.op("Concat", [angles, angles], f"{p}/full", axis=-1)
    else:
        col = e.op("Unsqueeze", [angles, e.ints(f"{p}/last", [-1])], f"{p}/col")
        both = e.op("Concat", [col, col], f"{p}/both", axis=-1)
        full = e.op("Reshape", [both, e.ints(f"{p}/flat", [0, 0, -1])], f"{p}/full")
    full = e.op("Unsqueeze", [full, e.ints(f"{p}/heads", [2])], f"{p}/full4")
    return e.op("Cos", [full], f"{p}/cos"), e.op("Sin", [full], f"{p}/sin")


def apply_rope(e: Emitter, x: str, tables: tuple[str, str], name: str) -> str:
    """``x * cos + rotate(x) * sin`` for ``x`` ``[batch, q, heads, head_dim]``."""
    d = e.model.head_dim
    if e.model.rope_layout == "neox":
        first = e.op(
            "Slice",
            [
                x,
                e.ints(f"{name}/s0", [0]),
                e.ints(f"{name}/h", [d // 2]),
                e.ints(f"{name}/ax", [-1]),
            ],
            f"{name}/x1",
        )
        second = e.op(
            "Slice",
            [
                x,
                e.ints(f"{name}/s1", [d // 2]),
                e.ints(f"{name}/e", [d]),
                e.ints(f"{name}/ax2", [-1]),
            ],
            f"{name}/x2",
        )
        neg = e.op("Neg", [second], f"{name}/neg")
        rotated = e.op("Concat", [neg, first], f"{name}/rot", axis=-1)
    else:
        pairs = e.op(
            "Reshape", [x, e.ints(f"{name}/pairs_shape", [0, 0, 0, -1, 2])], f"{name}/pairs"
        )
        even = e.op(
            "Slice",
            [
                pairs,
                e.ints(f"{name}/s0", [0]),
                e.ints(f"{name}/s1", [1]),
                e.ints(f"{name}/ax", [-1]),
            ],
            f"{name}/even",
        )
        odd = e.op(
            "Slice",
            [
                pairs,
                e.ints(f"{name}/t0", [1]),
                e.ints(f"{name}/t1", [2]),
                e.ints(f"{name}/ax2", [-1]),
            ],
            f"{name}/odd",
        )
        neg = e.op("Neg", [odd], f"{name}/neg")
        turned = e.op("Concat", [neg, even], f"{name}/turned", axis=-1)
        rotated = e.op("Reshape", [turned, e.ints(f"{name}/back", [0, 0, 0, -1])], f"{name}/rot")
    cos, sin = tables
    a = e.op("Mul", [x, cos], f"{name}/xcos")
    b = e.op("Mul", [rotated, sin], f"{name}/rsin")
    return e.op("Add", [a, b], f"{name}/out")


def _heads(e: Emitter, x: str, count: int, name: str) -> str:
    return e.op("Reshape", [x, e.ints(f"{name}/shape", [0, 0, count, e.model.head_dim])], name)


def _qkv(e: Emitter, i: int, h: str) -> tuple[str, str, str]:
    m = e.model
    b = f"blk.{i}"
    if m.architecture == Architecture.PHI3:
        fused = e.linear(f"{b}.attn_qkv.weight", h)
        q_len, kv_len = m.heads * m.head_dim, m.kv_heads * m.head_dim
        splits = e.ints(f"{b}/qkv_split", [q_len, kv_len, kv_len])
        names = [f"{b}/q", f"{b}/k", f"{b}/v"]
        e.nodes.append(helper.make_node("Split", [fused, splits], names, f"{b}/qkv", axis=-1))
        return names[0], names[1], names[2]
    out = []
    for kind in ("q", "k", "v"):
        y = e.linear(f"{b}.attn_{kind}.weight", h)
        if f"{b}.attn_{kind}.bias" in m.tensors:
            y = e.op("Add", [y, e.vector(f"{b}.attn_{kind}.bias")], f"{b}/{kind}_biased")
        out.append(y)
    return out[0], out[1], out[2]


def attention(e: Emitter, i: int, h: str) -> str:
    """Layer ``i``'s attention on normed ``h``; adds ``present.{i}.key/value`` outputs."""
    m = e.model
    b = f"blk.{i}"
    q, k, v = _qkv(e, i, h)
    q = _heads(e, q, m.heads, f"{b}/q4")
    k = _heads(e, k, m.kv_heads, f"{b}/k4")
    v = _heads(e, v, m.kv_heads, f"{b}/v4")
    if f"{b}.attn_q_norm.weight" in m.tensors:
        q = rms_norm(e, q, f"{b}.attn_q_norm.weight", f"{b}/q_norm")
        k = rms_norm(e, k, f"{b}.attn_k_norm.weight", f"{b}/k_norm")
    sliding = m.sliding(i)
    base, scale = (SWA_ROPE_BASE, 1.0) if sliding else (m.rope_base, m.rope_scale)
    tables = e.shared(f"rope{base}/{scale}", lambda: "|".join(rope_tables(e, base, scale)))
    cos, sin = tables.split("|")
    q = apply_rope(e, q, (cos, sin), f"{b}/q_rope")
    k = apply_rope(e, k, (cos, sin), f"{b}/k_rope")
    groups = m.heads // m.kv_heads
    q = e.op(
        "Reshape", [q, e.ints(f"{b}/grouped", [0, 0, m.kv_heads, groups, m.head_dim])], f"{b}/qg"
    )
    q = e.op("Transpose", [q], f"{b}/qt", perm=[0, 2, 3, 1, 4])
    q = e.op("Mul", [q, e.floats(f"{b}/scale", m.attention_scale)], f"{b}/qs")
    k = e.op("Transpose", [k], f"{b}/kt", perm=[0, 2, 1, 3])
    v = e.op("Transpose", [v], f"{b}/vt", perm=[0, 2, 1, 3])
    keys = e.op("Concat", [f"past.{i}.key", k], f"present.{i}.key", axis=2)
    values = e.op("Concat", [f"past.{i}.value", v], f"present.{i}.value", axis=2)
    ctx = _attend(e, b, q, keys, values, m.sliding_window if sliding else None)
    ctx = e.op("Transpose", [ctx], f"{b}/ctx_t", perm=[0, 3, 1, 2, 4])
    ctx = e.op("Reshape", [ctx, e.ints(f"{b}/merge", [0, 0, -1])], f"{b}/ctx_flat")
    return e.linear(f"{b}.attn_output.weight", ctx)


def _attend(e: Emitter, b: str, q: str, keys: str, values: str, window: int | None) -> str:
    """``softmax(q k^T + mask) v`` for grouped queries ``q`` ``[batch, kv_heads, groups, q,
    head_dim]`` over ``keys`` / ``values`` ``[batch, kv_heads, total, head_dim]``.

    Built so that a query's result is bit for bit the same in a one-token step and in a pass
    of several tokens (a speculative verify pass), whatever the context length:

    - the queries run on at least two rows (:func:`kernels_codes.at_least_two_rows`), kept
      through the softmax and the value product and cut back at the end, so no product takes
      ONNX Runtime's one-row kernel;
    - the scores are computed transposed, ``keys @ q^T`` (``[total, q]``): the context length
      is the product's row count, on which nothing depends. ``q @ keys^T`` would have it as
      the column count, and MLAS's SGEMM picks its K blocking from the column count (a
      ``head_dim`` of 256 is summed in one block up to 64 columns, in two of 128 above), so a
      pass, which sees more keys than the step of the same token, would add in another order;
    - in the value product the context length is the sum's length: a pass sums its masked
      keys' zero weights on top, which changes no bit.
    """
    nodes, padded, rows = kernels_codes.at_least_two_rows(f"{b}/q2", q)
    e.nodes.extend(nodes)
    ax = e.ints(f"{b}/ax2", [2])
    qt = e.op("Transpose", [padded], f"{b}/qt2", perm=[0, 1, 2, 4, 3])
    k5 = e.op("Unsqueeze", [keys, ax], f"{b}/k5")
    scores = e.op("MatMul", [k5, qt], f"{b}/scores_t")
    scores = e.op("Transpose", [scores], f"{b}/scores", perm=[0, 1, 2, 4, 3])
    mask = e.shared(f"mask{window}", lambda: causal_mask(e, window))
    scores = e.op("Add", [scores, mask], f"{b}/masked")
    probs = e.op("Softmax", [scores], f"{b}/probs", axis=-1)
    ctx = e.op("MatMul", [probs, e.op("Unsqueeze", [values, ax], f"{b}/v5")], f"{b}/ctx2")
    e.nodes.append(kernels_codes.first_rows(f"{b}/q2", ctx, rows, f"{b}/ctx"))
    return f"{b}/ctx"


def _gelu_tanh(e: Emitter, x: str, name: str) -> str:
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (ggml_gelu)."""
    cube = e.op("Mul", [e.op("Mul", [x, x], f"{name}/x2"), x], f"{name}/x3")
    inner = e.op(
        "Add",
        [x, e.op("Mul", [cube, e.floats(f"{name}/a", 0.044715)], f"{name}/ax3")],
        f"{name}/in",
    )
    t = e.op(
        "Tanh",
        [e.op("Mul", [inner, e.floats(f"{name}/c", np.sqrt(2 / np.pi))], f"{name}/arg")],
        f"{name}/tanh",
    )
    one = e.op("Add", [t, e.floats(f"{name}/one", 1.0)], f"{name}/onep")
    return e.op(
        "Mul", [e.op("Mul", [x, one], f"{name}/xg"), e.floats(f"{name}/half", 0.5)], f"{name}/out"
    )


def _silu(e: Emitter, x: str, name: str) -> str:
    return e.op("Mul", [x, e.op("Sigmoid", [x], f"{name}/sig")], f"{name}/out")


def feed_forward(e: Emitter, i: int, h: str) -> str:
    """Layer ``i``'s gated FFN on normed ``h`` (SwiGLU; Gemma 3: GELU-tanh gate)."""
    m = e.model
    b = f"blk.{i}"
    if m.architecture == Architecture.PHI3:
        fused = e.linear(f"{b}.ffn_up.weight", h)
        gate, up = f"{b}/gate", f"{b}/up"
        sizes = e.ints(f"{b}/ffn_split", [m.ffn, m.ffn])
        e.nodes.append(
            helper.make_node("Split", [fused, sizes], [gate, up], f"{b}/gate_up", axis=-1)
        )
    else:
        gate = e.linear(f"{b}.ffn_gate.weight", h)
        up = e.linear(f"{b}.ffn_up.weight", h)
    if m.architecture == Architecture.GEMMA3:
        act = _gelu_tanh(e, gate, f"{b}/gelu")
    else:
        act = _silu(e, gate, f"{b}/silu")
    return e.linear(f"{b}.ffn_down.weight", e.op("Mul", [act, up], f"{b}/glu"))


def layer(e: Emitter, i: int, x: str) -> str:
    """Block ``i`` on the hidden state ``x``; returns the next hidden state."""
    m = e.model
    b = f"blk.{i}"
    gemma = m.architecture == Architecture.GEMMA3
    h = rms_norm(e, x, f"{b}.attn_norm.weight", f"{b}/attn_norm")
    a = attention(e, i, h)
    if gemma:
        a = rms_norm(e, a, f"{b}.post_attention_norm.weight", f"{b}/post_attn_norm")
    x = e.op("Add", [x, a], f"{b}/attn_res")
    h = rms_norm(e, x, f"{b}.ffn_norm.weight", f"{b}/ffn_norm")
    f = feed_forward(e, i, h)
    if gemma:
        f = rms_norm(e, f, f"{b}.post_ffw_norm.weight", f"{b}/post_ffw_norm")
    return e.op("Add", [x, f], f"{b}/out")


def row_chunks(rows: int, cols: int, chunk_values: int) -> list[tuple[int, int]]:
    """Row ranges splitting a ``[rows, cols]`` table into pieces of at most about
    ``chunk_values`` values (one piece when it is smaller)."""
    pieces = max(1, -(-rows * cols // chunk_values))
    size = -(-rows // pieces)
    return [(r, min(r + size, rows)) for r in range(0, rows, size)]
