"""Writing a split's segment files, optionally through a :class:`SegmentCache`."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import external_data_helper

from hostkit.files import file_sha256
from partitioner.analysis.modelio import save_model
from partitioner.analysis.shapes import symbolic_types
from partitioner.cutting.inputs import Analysis, SplitOptions
from partitioner.cutting.segment_cache import SegmentCache
from partitioner.cutting.segments import SegmentSpec, build_segment, plan_segments

SEGMENT_FILE = re.compile(r"^segment\d+\.onnx(\.data)?$")


@dataclass(frozen=True)
class WrittenSegment:
    """A segment on disk."""

    spec: SegmentSpec
    files: tuple[Path, ...]
    """The ``.onnx`` file first, then its external data file if any."""
    sha256: str


def write_segments(
    analysis: Analysis,
    cuts: Sequence[int],
    out_dir: Path,
    *,
    source_dir: Path | None = None,
    external_threshold_bytes: int | None = None,
    cache: CachedCuts | None = None,
) -> list[WrittenSegment]:
    """Cut at main positions ``cuts`` and write ``segment<k>.onnx`` files into ``out_dir``.

    ``source_dir`` is the directory of the model file (where its external data lives). Stale
    ``segment*.onnx`` files from an earlier split are removed first. With ``cache``, segments
    cut the same way before are taken from it instead of being built again.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.iterdir():
        if SEGMENT_FILE.match(stale.name) and stale.is_file():
            stale.unlink()
    specs = plan_segments(analysis.index, analysis.frontier, cuts)
    types = symbolic_types(analysis.model, analysis.index)
    written: list[WrittenSegment] = []
    for spec in specs:
        path = out_dir / f"segment{spec.index}.onnx"
        key = cache.key(spec) if cache is not None else ""
        sha256 = cache.segments.fetch(key, path) if cache is not None else None
        if sha256 is not None:
            written.append(WrittenSegment(spec, (path,), sha256))
            continue
        segment = build_segment(analysis.model, analysis.index, spec, types, analysis.table)
        files = save_model(
            segment,
            path,
            source_dir=source_dir,
            external_threshold_bytes=external_threshold_bytes,
        )
        del segment  # one segment's copy of the weights alive at a time
        sha256 = file_sha256(files[0])
        if cache is not None and len(files) == 1:
            cache.segments.store(key, files[0], sha256)
        written.append(WrittenSegment(spec, tuple(files), sha256))
    return written


@dataclass(frozen=True)
class CachedCuts:
    """A :class:`SegmentCache` and what, besides a segment's spec, decides its file."""

    segments: SegmentCache
    model_sha256: str
    settings: Mapping[str, object]

    def key(self, spec: SegmentSpec) -> str:
        """The cache key of ``spec``."""
        return self.segments.key(self.model_sha256, spec, self.settings)


def cached_cuts(opts: SplitOptions, model_sha256: str, model: onnx.ModelProto) -> CachedCuts | None:
    """The segment cache, unless none is set or the model keeps weights in external files
    (which its own hash does not cover)."""
    external = any(external_data_helper.uses_external_data(t) for t in model.graph.initializer)
    if opts.segment_cache is None or external:
        return None
    settings = {
        "dims": sorted(opts.dims.items()),
        "max_units": opts.max_units,
        "carry_io": opts.carry_io,
        "external_threshold_bytes": opts.external_threshold_bytes,
    }
    return CachedCuts(SegmentCache(opts.segment_cache), model_sha256, settings)
