"""The segment cache: the same model cut the same way again is taken from the cache, byte for
byte, without building a segment; anything that changes the files misses."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import pytest
from graph_helpers import block_stack

from partitioner.analysis.runtime_memory import RuntimeMemory
from partitioner.cutting import segment_files
from partitioner.cutting.inputs import SplitOptions
from partitioner.cutting.segment_cache import SegmentCache
from partitioner.cutting.split import split_model
from protocols.devices import DeviceList

BLOCKS = 6
BARE = RuntimeMemory(overhead_bytes=0, arena_floor_bytes=0, workspace_factor=0.0)
"""Memory planned for weights and buffers only, so small devices force a several-way cut."""


def _devices(count: int, memory: int = 1 << 30) -> DeviceList:
    specs = [
        {"name": f"d{i}", "memory_bytes": memory, "gflops": 1.0, "bandwidth_mbps": 1000.0}
        for i in range(count)
    ]
    return DeviceList.from_obj({"devices": specs})


def _model(path: Path, seed: int = 0) -> Path:
    onnx.save(block_stack(BLOCKS, seed=seed), str(path))
    return path


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("segment*.onnx"))}


def _no_building(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> onnx.ModelProto:
        raise AssertionError("a cached segment was built again")

    monkeypatch.setattr(segment_files, "build_segment", refuse)


def test_the_same_cut_again_comes_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(tmp_path / "m.onnx")
    options = SplitOptions(segment_cache=tmp_path / "cache", dims={"batch": 1}, runtime=BARE)
    first = split_model(model, _devices(3, 200_000), tmp_path / "a", options)
    assert len(first.manifest.segments) > 1
    assert len(list((tmp_path / "cache").glob("*.onnx"))) == len(first.manifest.segments)
    _no_building(monkeypatch)
    second = split_model(model, _devices(3, 200_000), tmp_path / "b", options)
    assert _files(tmp_path / "b") == _files(tmp_path / "a")
    assert [s.sha256 for s in second.manifest.segments] == [
        s.sha256 for s in first.manifest.segments
    ]


def test_another_cut_or_other_weights_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options = SplitOptions(segment_cache=tmp_path / "cache", dims={"batch": 1}, runtime=BARE)
    model = _model(tmp_path / "m.onnx")
    split_model(model, _devices(3, 200_000), tmp_path / "a", options)
    whole = split_model(model, _devices(1), tmp_path / "whole", options)  # one segment: a miss
    assert len(whole.manifest.segments) == 1
    other = _model(tmp_path / "m2.onnx", seed=1)
    _no_building(monkeypatch)
    with pytest.raises(AssertionError, match="built again"):
        split_model(other, _devices(3, 200_000), tmp_path / "c", options)


def test_prune_drops_the_least_recently_used(tmp_path: Path) -> None:
    cache = SegmentCache(tmp_path / "cache", max_bytes=250)
    for k, age in (("old", 100), ("mid", 200), ("new", 300)):
        source = tmp_path / f"{k}.bin"
        source.write_bytes(bytes(100))
        cache.store(k, source, f"sha-{k}")
        os.utime(cache.root / f"{k}.onnx", (age, age))
    cache.prune()
    kept = sorted(p.stem for p in cache.root.glob("*.onnx"))
    assert kept == ["mid", "new"]
    assert not (cache.root / "old.sha256").exists()
    assert cache.fetch("old", tmp_path / "x.onnx") is None
    assert cache.fetch("new", tmp_path / "y.onnx") == "sha-new"
    assert (tmp_path / "y.onnx").read_bytes() == bytes(100)
