"""LoRA on exported decoders: where the torch weights live in the graph, where layers begin, and
merging trained adapters into the initializers (``ModelProto`` in, ``ModelProto`` out).

- :func:`weight_map`: torch parameter name -> the ONNX initializers holding it. The dynamo
  exporter keeps the names of weights it reads as they are (embeddings, norms) but folds
  ``x @ W.T`` into a ``MatMul`` with a fresh ``val_N`` constant holding ``W.T``, so names alone
  do not tell; the map is found by value, once, where both the torch model and the graph exist.
- :func:`layer_boundary`: the residual-stream tensor that feeds decoder layer ``i`` (found from
  the graph: the nearest ancestor of the layer's ``q_proj`` MatMul that a residual ``Add``
  reads and that has the hidden size as its last dimension).
- :func:`merge_adapters`: ``W' = W + (alpha / rank) · B · A``, written in the initializer's own
  layout (transposed where the map says so). Only initializers of adapted layers change.

Quantized served decoders (int8, int4) are mapped and merged through
:mod:`partitioner.models.lora_quant`: the map points at the quantized data (a
:class:`~protocols.lora.QuantRef` says how to dequantize it), and a merge re-quantizes
``W_deq + (alpha / rank) · B · A`` in the served format.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from partitioner.errors import GraphError
from partitioner.models.decoders.int8rows import SUFFIX as PER_ROW
from partitioner.models.decoders.int8rows import refreshed_column_sums
from partitioner.models.lora_quant import (
    QUANTIZED_MATMULS,
    dequantized,
    quantized_weights,
    requantized,
)
from protocols.lora import AdapterSpec, LoraSettings, WeightRef

Adapters = Mapping[str, tuple[np.ndarray, np.ndarray]]
"""Adapted module name -> (A ``[rank, in]``, B ``[out, rank]``)."""


def weight_map(
    named_params: Mapping[str, np.ndarray], model: onnx.ModelProto
) -> dict[str, list[WeightRef]]:
    """Every float parameter of ``named_params`` -> the initializers equal to it or its
    transpose, and the quantized initializers holding it (:func:`quantized_refs`).

    Raises :class:`GraphError` when a parameter is in no initializer (the graph would not be
    the model's).
    """
    by_shape: dict[tuple[int, ...], list[tuple[str, np.ndarray]]] = defaultdict(list)
    for tensor in model.graph.initializer:
        if tensor.data_type != onnx.TensorProto.FLOAT:
            continue
        array = numpy_helper.to_array(tensor)
        by_shape[tuple(array.shape)].append((tensor.name, array))
    out: dict[str, list[WeightRef]] = {}
    for name, param in named_params.items():
        refs = [
            WeightRef(initializer=init, transpose=False)
            for init, array in by_shape.get(tuple(param.shape), [])
            if np.array_equal(array, param)
        ]
        if param.ndim == 2:
            refs += [
                WeightRef(initializer=init, transpose=True)
                for init, array in by_shape.get(tuple(param.shape[::-1]), [])
                if np.array_equal(array, param.T)
            ]
        if not refs and param.ndim == 1:  # Gemma's RMSNorm scales by (1 + weight), folded
            refs = [
                WeightRef(initializer=init, offset=1.0)
                for init, array in by_shape.get(tuple(param.shape), [])
                if np.allclose(array, param + 1.0, rtol=0, atol=1e-6)
            ]
        out[name] = refs
    for name, refs in quantized_refs(named_params, model).items():
        out[name] = [*out[name], *refs]
    missing = [name for name, refs in out.items() if not refs]
    if missing:
        shape = named_params[missing[0]].shape
        raise GraphError(f"parameter {missing[0]} {shape} is in no initializer of the graph")
    return out


def quantized_refs(
    named_params: Mapping[str, np.ndarray], model: onnx.ModelProto
) -> dict[str, list[WeightRef]]:
    """Parameters -> the quantized initializers whose dequantized weight is the parameter (or
    its transpose) to within one quantization step.

    Matched by value, not by name: the quantizers rename what they quantize, and the float
    export the names came from is not beside the served model. Each quantized weight is
    dequantized once and compared with the parameters of its shape; two distinct weights differ
    by far more than a step (their entries are about 127 steps wide in int8, 8 in int4).
    """
    inits = {t.name: t for t in model.graph.initializer}
    by_shape: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for name, param in named_params.items():
        by_shape[tuple(param.shape)].append(name)
    out: dict[str, list[WeightRef]] = defaultdict(list)
    for data, quant in quantized_weights(model).items():
        shape = tuple(quant.shape)
        flips = [(False, shape)] + ([(True, shape[::-1])] if len(shape) == 2 else [])
        candidates = [(t, n) for t, sh in flips for n in by_shape.get(sh, [])]
        if not candidates:
            continue
        weight = dequantized(quant, data, inits)
        step = 1.01 * float(np.max(numpy_helper.to_array(inits[quant.scale]))) + 1e-7
        for transpose, name in candidates:
            param = named_params[name].T if transpose else named_params[name]
            if _within(weight, param, step):
                out[name].append(WeightRef(initializer=data, transpose=transpose, quantized=quant))
    return out


def _within(weight: np.ndarray, param: np.ndarray, step: float, rows: int = 4096) -> bool:
    """``max |weight - param| <= step``, a slice first, then in row chunks (no big copies)."""
    if weight.shape != param.shape:
        return False
    head = (slice(0, min(8, weight.shape[0])),)
    if np.max(np.abs(weight[head] - param[head]), initial=0.0) > step:
        return False
    return all(
        np.max(np.abs(weight[i : i + rows] - param[i : i + rows]), initial=0.0) <= step
        for i in range(0, weight.shape[0], rows)
    )


def torch_params(model: Any) -> dict[str, np.ndarray]:
    """``named_parameters`` of a torch model as float32 numpy arrays (tied weights once each)."""
    return {
        name: p.detach().to(dtype=__import__("torch").float32).cpu().numpy()
        for name, p in model.named_parameters()
    }


LAYER_LISTS = ("layers", "layer")
"""Module lists of the transformer layers (decoders: ``model.layers``, BERT: ``encoder.layer``)."""
Q_PROJECTIONS = (
    "layers.{i}.self_attn.q_proj.weight",
    "encoder.layer.{i}.attention.self.query.weight",
)
"""Where layer ``i``'s query projection lives (decoders, BERT)."""


def _layer_of(parts: Sequence[str]) -> int | None:
    for name in LAYER_LISTS:
        if name in parts[:-1]:
            return int(parts[parts.index(name) + 1])
    return None


def adapter_specs(
    named_shapes: Mapping[str, Sequence[int]], first_layer: int, settings: LoraSettings
) -> list[AdapterSpec]:
    """The adapted linear layers of transformer layers ``>= first_layer``, in parameter order."""
    specs = []
    for name, shape in named_shapes.items():
        parts = name.split(".")
        layer = _layer_of(parts)
        if len(shape) != 2 or parts[-1] != "weight" or layer is None:
            continue
        if layer >= first_layer and parts[-2] in settings.target_modules:
            specs.append(
                AdapterSpec(
                    module=".".join(parts[:-1]), out_features=shape[0], in_features=shape[1]
                )
            )
    if not specs:
        raise GraphError(f"no layer from {first_layer} on has {settings.target_modules}")
    return specs


def _ref_in(refs: Sequence[WeightRef], names: set[str]) -> WeightRef | None:
    return next((r for r in refs if r.initializer in names), None)


def layer_boundary(
    model: onnx.ModelProto, wmap: Mapping[str, Sequence[WeightRef]], layer: int
) -> str:
    """The residual-stream tensor feeding transformer layer ``layer`` (see the module doc); the
    additions of an int8 graph's per-row quantizers (:mod:`partitioner.models.decoders.int8rows`)
    are not the residual stream's."""
    suffixes = tuple(q.format(i=layer) for q in Q_PROJECTIONS)
    key = next((k for k in wmap if k.endswith(suffixes)), None)
    if key is None:
        raise GraphError(f"no q_proj weight of layer {layer} in the weight map")
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {
        v.name: [
            d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim
        ]
        for v in [*inferred.graph.value_info, *inferred.graph.input]
    }
    producer = {out: node for node in model.graph.node for out in node.output}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            readers[name].append(node)
    weight = {r.initializer for r in wmap[key]}
    matmul = next(
        (
            n
            for n in model.graph.node
            if n.op_type in ("MatMul", *QUANTIZED_MATMULS) and weight & set(n.input)
        ),
        None,
    )
    if matmul is None:
        raise GraphError(f"no MatMul reads the q_proj weight of layer {layer}")
    ref = next(r for r in wmap[key] if r.initializer in set(matmul.input))
    init = next(t for t in model.graph.initializer if t.name == ref.initializer)
    dims = ref.quantized.shape if ref.quantized else list(init.dims)
    hidden = int(dims[0] if ref.transpose else dims[1])
    queue: deque[str] = deque(n for n in matmul.input if n not in weight)
    seen: set[str] = set()
    while queue:
        name = queue.popleft()
        if name in seen:
            continue
        seen.add(name)
        shape = shapes.get(name, [])
        if (
            len(shape) == 3
            and shape[-1] == hidden
            and any(r.op_type == "Add" and PER_ROW not in r.name for r in readers[name])
        ):
            return name
        node = producer.get(name)
        if node is not None:
            queue.extend(node.input)
    raise GraphError(f"no residual-stream tensor feeds layer {layer}")


def cut_at(model: onnx.ModelProto, boundary: str) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """Cut ``model`` into (everything up to ``boundary``, everything after it).

    The head outputs ``boundary`` and the model outputs computed before it (earlier layers'
    presents); the tail reads ``boundary`` and whichever model inputs it still needs (masks and
    rotary positions are recomputed there from ``attention_mask`` and ``position_ids``).
    """
    inferred = onnx.shape_inference.infer_shapes(model)
    extractor = onnx.utils.Extractor(inferred)
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    early = [o for o in outputs if not _depends_on(model, o, boundary)]
    head = extractor.extract_model(inputs, [boundary, *early])
    tail = extractor.extract_model([boundary, *inputs], [o for o in outputs if o not in early])
    for part in (head, tail):
        part.ir_version = model.ir_version
        _drop_unused_inputs(part)
    return head, tail


def _depends_on(model: onnx.ModelProto, output: str, boundary: str) -> bool:
    """Whether computing ``output`` reads ``boundary``."""
    producer = {out: node for node in model.graph.node for out in node.output}
    stack, seen = [output], set()
    while stack:
        name = stack.pop()
        if name == boundary:
            return True
        if name in seen:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is not None:
            stack.extend(node.input)
    return False


def _drop_unused_inputs(model: onnx.ModelProto) -> None:
    used = {name for node in model.graph.node for name in node.input}
    used |= {o.name for o in model.graph.output}
    keep = [i for i in model.graph.input if i.name in used]
    del model.graph.input[:]
    model.graph.input.extend(keep)


def merged_initializers(
    segment: onnx.ModelProto,
    adapters: Adapters,
    wmap: Mapping[str, Sequence[WeightRef]],
    scale: float,
) -> dict[str, np.ndarray]:
    """The initializers of ``segment`` that the adapters change, with ``W + scale · B · A`` in
    each initializer's own layout; adapters of layers the segment does not hold are skipped.
    An int8 weight's column sums (:mod:`partitioner.models.decoders.int8rows`) follow its new
    values."""
    index = {t.name: t for t in segment.graph.initializer}
    merged = _merged(index, adapters, wmap, scale)
    return merged | refreshed_column_sums(segment.graph.node, merged, index)


def merged_by_segment(
    segments: Sequence[onnx.ModelProto],
    adapters: Adapters,
    wmap: Mapping[str, Sequence[WeightRef]],
    scale: float,
) -> dict[int, dict[str, np.ndarray]]:
    """:func:`merged_initializers` over a chain of segments: ``{segment index: {initializer:
    array}}``. A quantized weight's scale or zero point may sit in another segment than its
    data (the cut puts an initializer with the node that reads it: ``quantize_dynamic``
    multiplies by the weight's scale after ``MatMulInteger``), so the weights are merged over
    the chain's initializers and each result goes to every segment holding that name."""
    index = {t.name: t for seg in segments for t in seg.graph.initializer}
    merged = _merged(index, adapters, wmap, scale)
    nodes = [node for seg in segments for node in seg.graph.node]
    merged |= refreshed_column_sums(nodes, merged, index)
    out: dict[int, dict[str, np.ndarray]] = {}
    for i, seg in enumerate(segments):
        part = {t.name: merged[t.name] for t in seg.graph.initializer if t.name in merged}
        if part:
            out[i] = part
    return out


def _merged(
    index: Mapping[str, onnx.TensorProto],
    adapters: Adapters,
    wmap: Mapping[str, Sequence[WeightRef]],
    scale: float,
) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for module, (a, b) in adapters.items():
        refs = wmap.get(f"{module}.weight")
        if refs is None:
            raise GraphError(f"{module}.weight is not in the weight map")
        ref = _ref_in(refs, set(index))
        if ref is None:
            continue
        base = (
            dequantized(ref.quantized, ref.initializer, index)
            if ref.quantized
            else numpy_helper.to_array(index[ref.initializer])
        )
        delta = scale * (np.asarray(b, np.float64) @ np.asarray(a, np.float64))
        delta = delta.T if ref.transpose else delta
        if delta.shape != base.shape:
            raise GraphError(f"{module}: update {delta.shape} != initializer {base.shape}")
        if ref.initializer in out:
            raise GraphError(f"{ref.initializer} is shared by two adapted layers")
        merged = (base.astype(np.float64) + delta).astype(base.dtype)
        if ref.quantized is None:
            out[ref.initializer] = merged
        else:  # QLoRA: W_deq + scale·B·A, stored as the served weight was quantized
            out.update(requantized(ref.quantized, ref.initializer, merged, index))
    return out


def merge_adapters(
    segment: onnx.ModelProto,
    adapters: Adapters,
    wmap: Mapping[str, Sequence[WeightRef]],
    scale: float,
) -> onnx.ModelProto:
    """A copy of ``segment`` with the adapters merged (:func:`merged_initializers`)."""
    merged = merged_initializers(segment, adapters, wmap, scale)
    out = onnx.ModelProto()
    out.CopyFrom(segment)
    for tensor in out.graph.initializer:
        if tensor.name in merged:
            tensor.CopyFrom(numpy_helper.from_array(merged[tensor.name], tensor.name))
    return out


def adapters_by_module(
    specs: Sequence[AdapterSpec], arrays: Sequence[np.ndarray]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Wire-order arrays (A, B per adapter) -> ``{module: (A, B)}``, shapes checked."""
    if len(arrays) != 2 * len(specs):
        raise GraphError(f"{len(arrays)} arrays for {len(specs)} adapters")
    out = {}
    for k, spec in enumerate(specs):
        a, b = np.asarray(arrays[2 * k]), np.asarray(arrays[2 * k + 1])
        rank = a.shape[0]
        if a.shape != (rank, spec.in_features) or b.shape != (spec.out_features, rank):
            raise GraphError(f"{spec.module}: adapter shapes {a.shape}, {b.shape}")
        out[spec.module] = (a, b)
    return out


def initial_adapters(specs: Sequence[AdapterSpec], rank: int, seed: int) -> list[np.ndarray]:
    """Round-one adapters as PEFT starts them: ``A`` uniform in ``±1/sqrt(in)``, ``B`` zero, so
    the adapted model equals the base model until it trains."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    for spec in specs:
        bound = 1.0 / np.sqrt(spec.in_features)
        out.append(rng.uniform(-bound, bound, (rank, spec.in_features)).astype(np.float32))
        out.append(np.zeros((spec.out_features, rank), dtype=np.float32))
    return out
