"""ONNX segment surgery for training: cut a chain, read and rewrite weights, run it.

Graph surgery is ``ModelProto`` in, ``ModelProto`` out. ``partitioner`` had no segment export
when this was written, so :func:`cut_chain` is a small helper over ``onnx.utils.Extractor``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from coordinator.training.errors import SegmentError

FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE})


def cut_chain(model: onnx.ModelProto, boundaries: Sequence[str]) -> list[onnx.ModelProto]:
    """Cut ``model`` at the named boundary tensors into ``len(boundaries) + 1`` segments.

    Segment ``i`` reads the model inputs (for ``i == 0``) or boundary ``i - 1`` and produces
    boundary ``i`` (or the model outputs for the last). The model must be a chain at those
    boundaries: nothing after a boundary may read a tensor from before it.
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except (ValueError, onnx.shape_inference.InferenceError) as exc:
        raise SegmentError(f"cannot infer the model's tensor types: {exc}") from exc
    extractor = onnx.utils.Extractor(inferred)
    known = set(extractor.value_infos)
    for name in boundaries:
        if name not in known:
            raise SegmentError(f"boundary tensor {name!r} has no inferred type")
    model_inputs = [i.name for i in model.graph.input]
    initializers = {t.name for t in model.graph.initializer}
    model_inputs = [n for n in model_inputs if n not in initializers]
    model_outputs = [o.name for o in model.graph.output]
    ins = [model_inputs, *[[b] for b in boundaries]]
    outs = [*[[b] for b in boundaries], model_outputs]
    segments = []
    for seg_in, seg_out in zip(ins, outs, strict=True):
        try:
            seg = extractor.extract_model(seg_in, seg_out)
        except (ValueError, KeyError) as exc:
            raise SegmentError(f"cannot extract {seg_in} -> {seg_out}: {exc}") from exc
        seg.ir_version = model.ir_version
        segments.append(seg)
    return segments


def trainable_names(segment: onnx.ModelProto) -> list[str]:
    """Names of the segment's floating-point initializers, in graph order (its weights)."""
    return [t.name for t in segment.graph.initializer if t.data_type in FLOAT_TYPES]


def read_weights(segment: onnx.ModelProto, names: Sequence[str]) -> list[np.ndarray]:
    """The named initializers as numpy arrays, in the order asked."""
    by_name = {t.name: t for t in segment.graph.initializer}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise SegmentError(f"segment has no initializer {missing}")
    return [numpy_helper.to_array(by_name[n]).copy() for n in names]


def write_weights(segment: onnx.ModelProto, weights: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``segment`` whose named initializers hold ``weights``; nothing else changes.

    Each new array must have the initializer's shape; it is stored in the initializer's dtype.
    """
    out = onnx.ModelProto()
    out.CopyFrom(segment)
    seen = set()
    for i, tensor in enumerate(out.graph.initializer):
        if tensor.name not in weights:
            continue
        old = numpy_helper.to_array(tensor)
        new = np.asarray(weights[tensor.name])
        if new.shape != old.shape:
            raise SegmentError(f"{tensor.name}: shape {new.shape} != initializer {old.shape}")
        out.graph.initializer[i].CopyFrom(
            numpy_helper.from_array(new.astype(old.dtype, copy=False), tensor.name)
        )
        seen.add(tensor.name)
    missing = set(weights) - seen
    if missing:
        raise SegmentError(f"segment has no initializer {sorted(missing)}")
    return out


def run_chain(
    segments: Sequence[bytes | onnx.ModelProto], feeds: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Run segments in order with ONNX Runtime, each fed by name; return every tensor produced."""
    import onnxruntime as ort

    env = dict(feeds)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    for seg in segments:
        data = seg if isinstance(seg, bytes) else seg.SerializeToString()
        session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        outputs = session.run(None, {n: env[n] for n in names})
        for meta, value in zip(session.get_outputs(), outputs, strict=True):
            env[meta.name] = np.asarray(value)
    return env
