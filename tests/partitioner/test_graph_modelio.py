"""Model file I/O: external data in and out, models over 2 GB, hashes, bad files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from graph_helpers import OPSET, block_stack
from onnx import TensorProto, helper, numpy_helper

from hostkit.files import file_sha256
from partitioner.analysis.modelio import (
    EXTERNAL_DATA_SHA256_KEY,
    initializer_bytes,
    load_model,
)
from partitioner.cutting.split import analyse, write_segments
from partitioner.cutting.verify import verify_chain
from partitioner.errors import GraphError


def _save_external(model: onnx.ModelProto, path: Path) -> None:
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=path.name + ".weights",
        size_threshold=0,
    )


def test_external_data_model_loads_lazily_and_splits(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    path = source / "stack.onnx"
    _save_external(block_stack(4, width=512), path)
    model = load_model(path)
    big = [t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert big and not any(t.HasField("raw_data") for t in big)  # weights left on disk
    analysis = analyse(model)
    size = analysis.frontier.size
    out = tmp_path / "out"
    written = write_segments(analysis, [0, size // 2, size], out, source_dir=source)
    assert all(len(w.files) == 1 for w in written)  # small segments are self-contained
    result = verify_chain(path, [w.files[0] for w in written], [analysis.samples])
    assert result.max_abs_diff <= 1e-6


def test_segments_over_the_threshold_use_hashed_external_data(tmp_path: Path) -> None:
    model = block_stack(4)
    path = tmp_path / "stack.onnx"
    onnx.save(model, str(path))
    analysis = analyse(load_model(path))
    size = analysis.frontier.size
    written = write_segments(
        analysis, [0, size // 2, size], tmp_path / "out", external_threshold_bytes=1000
    )
    for seg in written:
        onnx_file, data_file = seg.files
        assert data_file.name == onnx_file.name + ".data"
        meta = {
            p.key: p.value
            for p in onnx.load(str(onnx_file), load_external_data=False).metadata_props
        }
        assert meta[EXTERNAL_DATA_SHA256_KEY] == file_sha256(data_file)
        assert seg.sha256 == file_sha256(onnx_file)
    result = verify_chain(path, [w.files[0] for w in written], [analysis.samples])
    assert result.max_abs_diff == 0.0


@pytest.mark.parametrize("width", [4, 128])
def test_external_data_outside_the_model_directory_is_refused(tmp_path: Path, width: int) -> None:
    """Small tensors are refused at load, large ones when their bytes are copied."""
    inner = tmp_path / "models"
    inner.mkdir()
    nbytes = 4096 * width * 4
    (tmp_path / "secret.bin").write_bytes(b"\0" * nbytes)
    weight = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[4096, width])
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../secret.bin"), ("offset", "0"), ("length", str(nbytes))):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "escape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4096])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])],
        [weight],
    )
    path = inner / "escape.onnx"
    onnx.save(helper.make_model(graph, opset_imports=OPSET), str(path))
    with pytest.raises(GraphError, match=r"outside|escapes"):
        analysis = analyse(load_model(path))
        write_segments(analysis, [0, 1], tmp_path / "out", source_dir=inner)


def test_missing_and_garbage_files_are_graph_errors(tmp_path: Path) -> None:
    with pytest.raises(GraphError, match="no such"):
        load_model(tmp_path / "absent.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x08\x07 this is not a protobuf \xff\xfe")
    with pytest.raises(GraphError):
        load_model(junk)


@pytest.mark.slow
def test_model_over_two_gigabytes_is_analysed_and_cut_without_loading_weights(
    tmp_path: Path,
) -> None:
    """A 2.4 GB weight (a sparse file) never enters memory; its segment streams to external data."""
    k = 24576
    source = tmp_path / "big"
    source.mkdir()
    with (source / "w.bin").open("wb") as fh:
        fh.truncate(k * k * 4)
    weight = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[k, k])
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", str(k * k * 4))):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    head = numpy_helper.from_array(np.ones((k, 8), np.float32), "H")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["y"]),
            helper.make_node("Relu", ["y"], ["r"]),
            helper.make_node("MatMul", ["r", "H"], ["z"]),
        ],
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", k])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 8])],
        [weight, head],
    )
    path = source / "big.onnx"
    onnx.save(helper.make_model(graph, opset_imports=OPSET), str(path))
    model = load_model(path)
    assert initializer_bytes(model) > 2**31
    analysis = analyse(model, dims={"n": 1})
    assert analysis.units.units[0].weight_bytes == k * k * 4
    written = write_segments(analysis, [0, 1, 3], tmp_path / "out", source_dir=source)
    big, small = written
    assert [p.name for p in big.files] == ["segment0.onnx", "segment0.onnx.data"]
    assert big.files[1].stat().st_size >= k * k * 4
    assert big.files[0].stat().st_size < 10_000
    assert len(small.files) == 1
    onnx.checker.check_model(str(big.files[0]))
    meta = {
        p.key: p.value
        for p in onnx.load(str(big.files[0]), load_external_data=False).metadata_props
    }
    assert len(meta[EXTERNAL_DATA_SHA256_KEY]) == 64  # its correctness: the small test above
    assert big.spec.outputs == ("y",) and small.spec.inputs == ("y",)
