"""Run segments as a chain in ONNX Runtime and compare with the whole model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from partitioner.errors import VerificationError

DEFAULT_TOLERANCE = 1e-5
"""Largest difference ``--verify`` accepts for a model that computes in float32."""
HALF_TOLERANCE = 5e-2
"""... and for one that computes in float16 or bfloat16: a few units in the last place at the
magnitude of a decoder's logits (float16 has 10 mantissa bits; ONNX Runtime fuses a whole
graph and its segments differently, so they round differently)."""
_HALF_TYPES = frozenset({onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})

Arrays = dict[str, np.ndarray]


@dataclass(frozen=True)
class VerifyResult:
    """Largest absolute difference between chained and whole-model outputs, per output."""

    max_abs_diff: float
    per_output: Mapping[str, float]
    tolerance: float


def default_tolerance(model: onnx.ModelProto) -> float:
    """:data:`HALF_TOLERANCE` when ``model`` stores weights or casts to a half-precision type,
    :data:`DEFAULT_TOLERANCE` otherwise (int4/int8 weights compute in float32)."""
    half = any(t.data_type in _HALF_TYPES for t in model.graph.initializer) or any(
        a.name == "to" and a.i in _HALF_TYPES
        for n in model.graph.node
        if n.op_type == "Cast"
        for a in n.attribute
    )
    return HALF_TOLERANCE if half else DEFAULT_TOLERANCE


def _session(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_model(path: Path, feeds: Mapping[str, np.ndarray]) -> Arrays:
    """Run one model file on ``feeds`` (only the inputs it declares are passed)."""
    return _run(_session(path), path.name, feeds)


def run_chain(segments: Sequence[Path], feeds: Mapping[str, np.ndarray]) -> Arrays:
    """Run segment files in order, each fed by name from ``feeds`` and earlier outputs."""
    return _chain([(_session(p), p.name) for p in segments], feeds)


def _run(session: Any, label: str, feeds: Mapping[str, np.ndarray]) -> Arrays:
    names = [i.name for i in session.get_inputs()]
    missing = [n for n in names if n not in feeds]
    if missing:
        raise VerificationError(f"{label}: no value for inputs {missing}", float("inf"))
    outputs = [o.name for o in session.get_outputs()]
    values = session.run(outputs, {n: feeds[n] for n in names})
    return {n: np.asarray(v) for n, v in zip(outputs, values, strict=True)}


def _chain(sessions: Sequence[tuple[Any, str]], feeds: Mapping[str, np.ndarray]) -> Arrays:
    known: Arrays = dict(feeds)
    for session, label in sessions:
        known.update(_run(session, label, known))
    return known


def compare(
    expected: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray]
) -> dict[str, float]:
    """Max absolute difference per output in ``expected`` (``inf`` if missing or misshapen)."""
    diffs: dict[str, float] = {}
    for name, want in expected.items():
        got = actual.get(name)
        if got is None or got.shape != want.shape:
            diffs[name] = float("inf")
        elif want.size == 0:
            diffs[name] = 0.0
        else:
            got64, want64 = got.astype(np.float64), want.astype(np.float64)
            nan = np.isnan(want64)
            if not np.array_equal(nan, np.isnan(got64)):
                diffs[name] = float("inf")
            else:
                delta = np.abs(got64[~nan] - want64[~nan])
                diffs[name] = float(delta.max()) if delta.size else 0.0
    return diffs


def verify_chain(
    model: Path,
    segments: Sequence[Path],
    samples: Sequence[Mapping[str, np.ndarray]],
    tolerance: float = DEFAULT_TOLERANCE,
) -> VerifyResult:
    """Compare the chain with the whole model on every sample.

    Raises :class:`VerificationError` when any output differs by more than ``tolerance``.
    """
    whole = _session(model)
    chain = [(_session(p), p.name) for p in segments]
    worst: dict[str, float] = {}
    for feeds in samples:
        expected = _run(whole, model.name, feeds)
        chained = _chain(chain, feeds)
        for name, diff in compare(expected, chained).items():
            worst[name] = max(worst.get(name, 0.0), diff)
    top = max(worst.values(), default=0.0)
    if top > tolerance:
        bad = ", ".join(f"{n}: {d:.3g}" for n, d in worst.items() if d > tolerance)
        raise VerificationError(
            f"chained segments differ from the whole model by up to {top:.3g} "
            f"(tolerance {tolerance:.3g}; {bad})",
            top,
        )
    return VerifyResult(max_abs_diff=top, per_output=worst, tolerance=tolerance)
