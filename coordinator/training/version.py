"""A deployment version on disk: ``manifest.json`` plus the segment files it lists.

Loading checks every segment file against the manifest's SHA-256. A version knows its trainable
weights (floating-point initializers) per segment, builds the :class:`~protocols.training.TrainPlan`
the ServerApp sends, and evaluates weights on a held-out set with ONNX Runtime.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from coordinator.training.errors import SegmentError
from coordinator.training.segments import read_weights, run_chain, trainable_names, write_weights
from protocols.errors import SchemaError
from protocols.manifest import Manifest
from protocols.training import ParamSpec, ShardSpec

MANIFEST_FILE = "manifest.json"
LINEAGE_FILE = "lineage.json"
SIGNATURE_FILE = "manifest.json.sig"


@dataclass(frozen=True)
class Version:
    """A loaded, hash-checked version directory."""

    path: Path
    manifest: Manifest
    segments: tuple[onnx.ModelProto, ...]

    @classmethod
    def load(cls, path: Path) -> Version:
        """Read ``path/manifest.json`` and every segment, checking their SHA-256."""
        try:
            manifest = Manifest.from_json((path / MANIFEST_FILE).read_bytes())
        except (OSError, SchemaError) as exc:
            raise SegmentError(f"{path}: cannot read the manifest: {exc}") from exc
        segments = []
        for entry in manifest.segments:
            try:
                data = (path / entry.file).read_bytes()
            except OSError as exc:
                raise SegmentError(f"{path}: cannot read segment {entry.file}: {exc}") from exc
            if hashlib.sha256(data).hexdigest() != entry.sha256:
                raise SegmentError(f"{path / entry.file}: SHA-256 differs from the manifest")
            segments.append(onnx.load_from_string(data))
        return cls(path, manifest, tuple(segments))

    @property
    def name(self) -> str:
        """The version's directory name (``v0001``, ...)."""
        return self.path.name

    def shard_specs(self, indices: Sequence[int]) -> list[ShardSpec]:
        """The wire description of the trainable shards ``indices`` (segment order)."""
        specs = []
        for index in sorted(indices):
            if not 0 <= index < len(self.segments):
                raise SegmentError(f"no segment {index} (the version has {len(self.segments)})")
            seg = self.segments[index]
            names = trainable_names(seg)
            if not names:
                raise SegmentError(f"segment {index} has no weights to train")
            arrays = read_weights(seg, names)
            entry = self.manifest.segments[index]
            specs.append(
                ShardSpec(
                    index=index,
                    file=entry.file,
                    sha256=entry.sha256,
                    params=[
                        ParamSpec(name=n, shape=list(a.shape))
                        for n, a in zip(names, arrays, strict=True)
                    ],
                )
            )
        return specs

    def weights(self, specs: Sequence[ShardSpec]) -> list[np.ndarray]:
        """The current arrays of ``specs``, in wire order."""
        out: list[np.ndarray] = []
        for spec in specs:
            out.extend(read_weights(self.segments[spec.index], [p.name for p in spec.params]))
        return out

    def full_weight_bytes(self) -> int:
        """Bytes of every floating-point weight of every segment (the full model's update)."""
        total = 0
        for seg in self.segments:
            total += sum(a.nbytes for a in read_weights(seg, trainable_names(seg)))
        return total


def split_by_shard(
    specs: Sequence[ShardSpec], arrays: Sequence[np.ndarray]
) -> dict[int, dict[str, np.ndarray]]:
    """Wire-order arrays back to ``{segment index: {initializer name: array}}``."""
    expected = sum(len(s.params) for s in specs)
    if len(arrays) != expected:
        raise SegmentError(f"{len(arrays)} arrays for a layout of {expected}")
    out: dict[int, dict[str, np.ndarray]] = {}
    k = 0
    for spec in specs:
        shard: dict[str, np.ndarray] = {}
        for param in spec.params:
            array = np.asarray(arrays[k])
            if list(array.shape) != param.shape:
                raise SegmentError(f"{param.name}: shape {array.shape} != {param.shape}")
            shard[param.name] = array
            k += 1
        out[spec.index] = shard
    return out


class HeldOutEvaluator:
    """Loss and accuracy of a version with new trainable weights, on a held-out set (ORT).

    The segments before the first trainable one never change during a run, so their output is
    computed once.
    """

    def __init__(
        self, version: Version, specs: Sequence[ShardSpec], x: np.ndarray, y: np.ndarray
    ) -> None:
        self.version = version
        self.specs = list(specs)
        self.first = min(s.index for s in self.specs)
        self.y = y.astype(np.int64)
        input_name = version.manifest.model.inputs[0].name
        self._features = run_chain(version.segments[: self.first], {input_name: x})
        self._output = version.manifest.model.outputs[0].name

    def logits(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """Model output for the held-out inputs with ``arrays`` as the trainable weights."""
        by_shard = split_by_shard(self.specs, arrays)
        tail = [
            write_weights(seg, by_shard[i]) if i in by_shard else seg
            for i, seg in enumerate(self.version.segments)
            if i >= self.first
        ]
        return run_chain(tail, self._features)[self._output]

    def __call__(self, arrays: list[np.ndarray]) -> tuple[float, float]:
        """(cross-entropy loss, accuracy)."""
        logits = self.logits(arrays).astype(np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        loss = float(-log_probs[np.arange(len(self.y)), self.y].mean())
        accuracy = float((logits.argmax(axis=1) == self.y).mean())
        return loss, accuracy
