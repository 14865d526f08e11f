"""Sample inputs for costing and verification.

In order of preference: a ``.npz`` file the user gives, inputs the front door embedded in the
model's metadata (real tokenizer output for text models), or synthesised inputs: integer inputs
used as indices into a weight table get random valid indices, other integers are ones (masks),
floats are standard normal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx

from partitioner.analysis.costs import ShapeTable
from partitioner.analysis.graph import GraphIndex
from partitioner.errors import GraphError

SAMPLE_INPUTS_KEY = "fedshard.sample_inputs"
"""Model metadata key holding JSON sample inputs (see :func:`encode_samples`)."""

Samples = dict[str, np.ndarray]

_INDEX_OPS = {"Gather": 1, "GatherElements": 1, "GatherND": 1}


def encode_samples(samples: Mapping[str, np.ndarray]) -> str:
    """JSON text ``{name: {"dtype", "shape", "data"}}`` (no pickle, easy to audit)."""
    return json.dumps(
        {
            name: {"dtype": str(a.dtype), "shape": list(a.shape), "data": a.ravel().tolist()}
            for name, a in samples.items()
        }
    )


def decode_samples(text: str) -> Samples:
    """Inverse of :func:`encode_samples`; raises :class:`GraphError` on malformed text."""
    try:
        raw = json.loads(text)
        return {
            name: np.asarray(v["data"], dtype=np.dtype(v["dtype"])).reshape(v["shape"])
            for name, v in raw.items()
        }
    except (ValueError, KeyError, TypeError) as exc:
        raise GraphError(f"malformed sample inputs: {exc}") from exc


def embedded_samples(model: onnx.ModelProto) -> Samples | None:
    """Sample inputs stored in the model's metadata by a front door, if any."""
    for prop in model.metadata_props:
        if prop.key == SAMPLE_INPUTS_KEY:
            return decode_samples(prop.value)
    return None


def load_npz(path: Path) -> Samples:
    """Arrays from an ``.npz`` file (pickles refused)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError) as exc:
        raise GraphError(f"{path}: cannot read sample inputs: {exc}") from exc


def synthesize(index: GraphIndex, table: ShapeTable, seed: int = 0) -> Samples:
    """Plausible inputs at the table's binding for every graph input."""
    rng = np.random.default_rng(seed)
    samples: Samples = {}
    for name in index.inputs:
        shape = table.shapes.get(name)
        if shape is None:
            raise GraphError(f"no shape known for model input {name!r}")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(shape.elem_type)
        if np.issubdtype(dtype, np.floating):
            samples[name] = rng.standard_normal(shape.dims).astype(dtype)
        elif dtype == np.bool_:
            samples[name] = np.ones(shape.dims, dtype=dtype)
        elif np.issubdtype(dtype, np.integer):
            bound = _index_bound(index, table, name)
            if bound is None:
                samples[name] = np.ones(shape.dims, dtype=dtype)
            else:
                samples[name] = rng.integers(0, bound, size=shape.dims).astype(dtype)
        else:
            raise GraphError(f"cannot synthesise model input {name!r} of type {dtype}")
    return samples


def _index_bound(index: GraphIndex, table: ShapeTable, name: str) -> int | None:
    """Smallest table size among the gathers that use ``name`` as indices into a constant."""
    bounds: list[int] = []
    for consumer in index.consumers.get(name, ()):
        node = index.nodes[consumer]
        position = _INDEX_OPS.get(node.op_type)
        if position is None or len(node.input) <= position or node.input[position] != name:
            continue
        data = node.input[0]
        if not index.is_static_tensor(data):
            continue
        axis = next((int(a.i) for a in node.attribute if a.name == "axis"), 0)
        dims = table.dims_of(data)
        if dims:
            bounds.append(dims[axis])
    return min(bounds) if bounds else None


def check_samples(index: GraphIndex, samples: Mapping[str, np.ndarray]) -> None:
    """Raise :class:`GraphError` unless ``samples`` gives every model input."""
    missing = [n for n in index.inputs if n not in samples]
    if missing:
        raise GraphError(f"sample inputs lack {missing}")
