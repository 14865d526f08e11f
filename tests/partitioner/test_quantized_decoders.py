"""Decoders stored in fp16, int8 and int4 by ONNX Runtime's own tools, through the partitioner.

The tiny random decoders (Llama, Gemma 3) are converted by
:func:`partitioner.models.decoders.precision.quantize_decoder`, cut at every unit boundary and
chained in ONNX Runtime against the whole converted model (the same quantized graph on both sides,
so they agree as closely as float32 does; float16 within a few units in the last place). Weights
count at their stored size, scales and zero points included.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from partitioner.analysis.costs import tensor_proto_bytes
from partitioner.analysis.modelio import initializer_bytes, load_model
from partitioner.analysis.runtime_memory import packed_extra_bytes
from partitioner.cutting.segment_files import write_segments
from partitioner.cutting.split import analyse
from partitioner.cutting.verify import (
    HALF_TOLERANCE,
    default_tolerance,
    run_chain,
    run_model,
    verify_chain,
)
from partitioner.models.decoders.ort_runner import read_info
from partitioner.models.decoders.precision import (
    SCHEMES,
    WEIGHTS,
    Weights,
    current_export,
    model_scheme,
    model_weights,
    quantize_decoder,
)
from partitioner.models.lora_quant import linear_bits
from protocols.decoder import DECODER_FILE, MODEL_FILE, DecoderInfo

pytestmark = pytest.mark.timeout(900)

QUANTIZED: tuple[Weights, ...] = ("fp16", "int8", "int4")
_CONVERTED: dict[tuple[str, str], Path] = {}


class Exports:
    """The session's tiny decoder exports, exported only when a test asks for one."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.request = request

    def __getitem__(self, name: str) -> Path:
        path: Path = self.request.getfixturevalue(name.replace("-", "_") + "_dir")
        return path


@pytest.fixture
def exports(request: pytest.FixtureRequest) -> Exports:
    return Exports(request)


def converted(exports: Exports, name: str, weights: Weights, tmp: pytest.TempPathFactory) -> Path:
    """``name``'s export in ``weights`` (converted once per module)."""
    if weights == "fp32":
        return exports[name]
    key = (name, weights)
    if key not in _CONVERTED:
        out = tmp.mktemp(f"{name}-{weights}")
        quantize_decoder(exports[name], out, weights)
        _CONVERTED[key] = out
    return _CONVERTED[key]


def _io(model: onnx.ModelProto) -> list[tuple[str, int]]:
    return [
        (v.name, v.type.tensor_type.elem_type) for v in [*model.graph.input, *model.graph.output]
    ]


def _info(export: Path) -> DecoderInfo:
    return DecoderInfo.from_json((export / DECODER_FILE).read_text())


def _prefill(info: DecoderInfo, ids: list[int]) -> dict[str, np.ndarray]:
    """A prefill of ``ids`` with an empty past (the other case a stage sees)."""
    feeds = {
        "input_ids": np.asarray([ids], np.int64),
        "attention_mask": np.ones((1, len(ids)), np.int64),
        "position_ids": np.arange(len(ids), dtype=np.int64)[None, :],
    }
    for pair in info.state:
        feeds[pair.past] = np.zeros((1, info.num_kv_heads, 0, info.head_dim), np.float32)
    return feeds


@pytest.mark.parametrize("weights", QUANTIZED)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_conversion_keeps_the_interface_and_stores_weights_smaller(
    exports: Exports, name: str, weights: Weights, tmp_path_factory: pytest.TempPathFactory
) -> None:
    source = load_model(exports[name] / MODEL_FILE)
    out = converted(exports, name, weights, tmp_path_factory)
    model = onnx.load(str(out / MODEL_FILE))
    assert model_weights(model) == weights
    assert model_scheme(out / MODEL_FILE) == SCHEMES.get(weights)
    assert current_export(out, weights) and current_export(exports[name], "fp32")
    assert not current_export(exports[name], weights) or weights not in SCHEMES  # none recorded
    info, source_info = _info(out), _info(exports[name])
    assert source_info.rows_independent
    if weights != "int4":  # int4's mark depends on this CPU: test_rows_independent_says_...
        assert info.rows_independent
    assert info.weights == weights and source_info.weights is None
    assert info.model_copy(update={"rows_independent": True, "weights": None}) == source_info
    assert read_info(out / MODEL_FILE) == info  # the graph's own copy says the same
    assert _io(model) == _io(source)  # KV cache and frames stay float32
    ops = {n.op_type for n in model.graph.node}
    ratio = initializer_bytes(model) / initializer_bytes(source)
    weights_read = {t.name for t in model.graph.initializer}
    float_matmuls = [
        n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights_read
    ]
    if weights == "int4":
        assert {"MatMulNBits", "GatherBlockQuantized"} <= ops and not float_matmuls
        assert ratio < 0.2
    elif weights == "int8":
        assert {"MatMulInteger", "DequantizeLinear"} <= ops and not float_matmuls
        assert ratio < 0.3
        inits = {t.name: t for t in model.graph.initializer}
        int8 = [inits[n.input[1]] for n in model.graph.node if n.op_type == "MatMulInteger"]
        assert int8 and {linear_bits(t) for t in int8} == {7}  # no u8s8 saturation on AVX2
    else:
        assert any(t.data_type == TensorProto.FLOAT16 for t in model.graph.initializer)
        assert 0.45 < ratio < 0.55


@pytest.mark.parametrize("weights", WEIGHTS)
def test_rows_independent_says_what_a_pass_computes(
    exports: Exports, weights: Weights, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """What ``rows_independent`` says is so: a token's candidates from a pass of one row equal
    those from a pass that also runs the token before it. int8 computes them bit for bit alike
    (its activations quantized per row, :mod:`partitioner.models.decoders.int8rows`), and so does
    int4 where ONNX Runtime's int4 kernel does (both have their float products run on two rows or
    more, see :mod:`partitioner.models.decoders.rowwise`); float32 and float16 do too, their
    products all run on at least two rows (a one-row product alone differs in the last bits)."""
    from partitioner.models.decoders.ort_runner import OrtDecoder

    decoder = OrtDecoder(converted(exports, "tiny-llama", weights, tmp_path_factory))
    ids = [1, 17, 301, 45, 9, 230, 77]
    decoder.prefill(ids[:-2])
    decoder.step(ids[-2:-1])
    alone = decoder.step(ids[-1:]).top_logits
    decoder.prefill(ids[:-2])
    together = decoder.step(ids[-2:]).top_logits
    gap = float(np.abs(alone - together).max())
    if weights == "int4":  # bit for bit alike where ONNX Runtime's int4 kernel is (AVX-512)
        assert decoder.info.rows_independent == (gap == 0.0), gap
    else:
        assert decoder.info.rows_independent
    if weights != "int4":  # exact integer products (int8), float ones on two rows or more
        assert gap == 0.0, gap


def test_an_export_whose_rows_differ_is_marked_coupled_in_both_copies(
    exports: Exports, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Where the int4 probe finds a token decoding differently alone and in a pass (ONNX
    Runtime's AVX2 kernels), the export is marked ``rows_independent: false`` in
    ``decoder.json`` and in the graph's own copy, and still loads and decodes."""
    import shutil

    from partitioner.models.decoders.ort_runner import OrtDecoder
    from partitioner.models.decoders.rowwise import mark_rows_coupled

    out = tmp_path / "int4"
    shutil.copytree(converted(exports, "tiny-llama", "int4", tmp_path_factory), out)
    before = _info(out)
    mark_rows_coupled(out)
    after = _info(out)
    assert not after.rows_independent and read_info(out / MODEL_FILE) == after
    assert after.model_copy(update={"rows_independent": before.rows_independent}) == before
    assert OrtDecoder(out).prefill([1, 17, 301]).top_ids.size > 0


def test_two_row_products_compute_each_row_as_a_pass_of_many_does() -> None:
    """The rewrite itself, on one attention-shaped product: unpadded, a one-row pass differs in
    the last bits from the same row in a pass of several (the kernels differ; measured here,
    not asserted, as it is ONNX Runtime's business); padded, every row count gives the same
    bits, and the values are the product's."""
    import onnxruntime as ort

    from partitioner.errors import GraphError
    from partitioner.models.decoders.rowwise import two_row_products

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["q", "k"], ["scores"], name="attn")],
        "attention",
        [
            helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, 4, "rows", 64]),
            helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, 4, 64, "past"]),
        ],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 4, 6, 64)).astype(np.float32)
    k = rng.standard_normal((1, 4, 64, 300)).astype(np.float32)

    def last_row_gaps(proto: onnx.ModelProto) -> list[float]:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(proto.SerializeToString(), options)
        whole = session.run(None, {"q": q, "k": k})[0]
        np.testing.assert_allclose(whole, q @ k, rtol=1e-4, atol=1e-4)
        tails = [session.run(None, {"q": q[:, :, -n:], "k": k})[0] for n in range(1, 6)]
        return [float(np.abs(t - whole[:, :, -t.shape[2] :]).max()) for t in tails]

    last_row_gaps(model)  # here (AVX-512): [1e-5, 0, 0, 0, 0]; the one-row kernel differs
    padded = two_row_products(onnx.ModelProto.FromString(model.SerializeToString()))
    assert [n.op_type for n in padded.graph.node].count("MatMul") == 1
    assert last_row_gaps(padded) == [0.0] * 5
    old = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(GraphError, match="opset 15"):
        two_row_products(old)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_cut_at_every_unit_boundary_matches_the_whole_model(
    exports: Exports,
    name: str,
    weights: Weights,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    export = converted(exports, name, weights, tmp_path_factory)
    model_path = export / MODEL_FILE
    analysis = analyse(load_model(model_path), carry_io=False)
    units = analysis.units
    info = _info(export)
    assert len(units.units) >= info.num_layers
    # every stored byte is some unit's or shared, counted at its stored size (scales and
    # zero points included) plus the scale copies int4's kernel packs; only small constants
    # several units recompute count twice
    stored = sum(u.weight_bytes for u in units.units) + sum(s.nbytes for s in units.shared)
    packed = packed_extra_bytes(analysis.index.nodes, analysis.index.initializers)
    assert bool(packed) == (weights == "int4")
    if weights != "fp16":
        total = initializer_bytes(analysis.model) + sum(packed.values())
        assert total <= stored <= total + (64 << 10)
    written = write_segments(analysis, units.boundaries, tmp_path, source_dir=export)
    assert len(written) == len(units.units)
    samples = [analysis.samples, _prefill(info, [5, 17, 99, 3, 42, 7])]
    tolerance = default_tolerance(analysis.model)
    assert tolerance == (HALF_TOLERANCE if weights == "fp16" else 1e-5)
    files = [w.files[0] for w in written]
    if weights != "fp16":
        result = verify_chain(model_path, files, samples, tolerance)
        assert result.max_abs_diff <= 1e-4  # the same kernels on both sides
        return
    for feeds in samples:  # float16: near-tied candidates may swap places, nothing else moves
        whole, chained = run_model(model_path, feeds), run_chain(files, feeds)
        for output, want in whole.items():
            if not output.endswith("top_ids"):  # top_ids, and the trailing positions' ids
                np.testing.assert_allclose(chained[output], want, atol=tolerance, rtol=0)
        gap = whole["top_logits"][0, 0] - whole["top_logits"][0, 1]
        if gap > 2 * tolerance:
            assert chained["top_ids"][0, 0] == whole["top_ids"][0, 0]


def test_fedshard_split_verifies_an_int4_decoder_over_three_devices(
    exports: Exports, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import argparse
    import json

    from partitioner.cli import split_cli
    from protocols.manifest import Manifest

    export = converted(exports, "tiny-gemma3", "int4", tmp_path_factory)
    weights = initializer_bytes(load_model(export / MODEL_FILE))
    devices = tmp_path / "devices.json"
    budget = weights // 2 + (24 << 20)
    devices.write_text(
        json.dumps(
            {
                "devices": [
                    {"name": f"d{i}", "memory_bytes": budget, "gflops": 10, "bandwidth_mbps": 1e3}
                    for i in range(3)
                ]
            }
        )
    )
    parser = argparse.ArgumentParser()
    split_cli.register(parser.add_subparsers())
    out = tmp_path / "split"
    args = parser.parse_args(
        [
            "split",
            str(export / MODEL_FILE),
            "--devices",
            str(devices),
            "--out",
            str(out),
            "--verify",
        ]
    )
    assert args.run(args) == 0
    manifest = Manifest.from_json((out / "manifest.json").read_text())
    assert len(manifest.segments) >= 2
    assert sum(s.param_bytes for s in manifest.segments) >= weights  # int4 bytes, not float32
    assert all(s.param_bytes < weights for s in manifest.segments)


def test_an_operator_without_schema_or_rule_is_named_not_guessed() -> None:
    from partitioner.errors import UncostableOperatorError

    f32 = TensorProto.FLOAT
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="first"),
        helper.make_node("Mystery", ["a"], ["b"], name="the_odd_one", domain="com.example"),
        helper.make_node("Relu", ["b"], ["y"], name="last"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", f32, [2, 8])],
        [helper.make_tensor_value_info("y", f32, [2, 8])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.example", 1)]
    )
    with pytest.raises(UncostableOperatorError) as caught:
        analyse(model)
    assert (caught.value.domain, caught.value.op_type, caught.value.node) == (
        "com.example",
        "Mystery",
        "the_odd_one",
    )
    assert "com.example::Mystery" in str(caught.value) and "the_odd_one" in str(caught.value)


def test_a_tied_int8_table_is_counted_once_in_every_stage_that_reads_it(tmp_path: Path) -> None:
    """``quantize_static`` (QDQ) stores the tied table once, as int8 with a scale and zero
    point; its ``DequantizeLinear`` is recomputed in the first and the last unit."""
    from graph_helpers import token_decoder, token_decoder_feeds
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    from partitioner.analysis.runtime_memory import GRAPH_ONLY
    from partitioner.planning.problem_from_graph import build_problem
    from partitioner.planning.semantics import stage_memory
    from protocols.devices import DeviceList

    class Feeds(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.left = [token_decoder_feeds()]

        def get_next(self) -> dict[str, np.ndarray] | None:
            return self.left.pop() if self.left else None

    source, out = tmp_path / "fp32.onnx", tmp_path / "int8.onnx"
    onnx.save(token_decoder(), str(source))
    quantize_static(
        str(source),
        str(out),
        Feeds(),
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=["Gather", "MatMul", "Transpose"],
    )
    model = load_model(out)
    analysis = analyse(model, samples=token_decoder_feeds())
    units = analysis.units
    tables = [
        s
        for s in units.shared
        if analysis.index.initializers[s.name].data_type in (TensorProto.INT8, TensorProto.UINT8)
    ]
    assert tables, [s.name for s in units.shared]
    table = max(tables, key=lambda s: s.nbytes)
    stored = analysis.index.initializers[table.name]
    assert table.nbytes == int(np.prod(stored.dims))  # one byte a weight, not four
    readers = sorted(table.units)
    assert readers[0] == 0 and readers[-1] >= len(units.units) - 2  # the embedding and the head
    gap = next((a + 1, b) for a, b in itertools.pairwise(readers) if b > a + 1)
    devices = DeviceList.from_obj(
        {"devices": [{"name": "a", "memory_bytes": 1, "gflops": 1, "bandwidth_mbps": 1}]}
    )
    problem = build_problem(units, devices, runtime=GRAPH_ONLY)
    n = len(units.units)

    def without_table(start: int, end: int) -> int:
        return sum(u.weight_bytes + u.workspace_bytes for u in units.units[start:end])

    whole = stage_memory(problem, 0, n)
    head, tail = stage_memory(problem, 0, 1), stage_memory(problem, readers[-1], n)
    assert whole >= table.nbytes and head >= table.nbytes and tail >= table.nbytes
    assert stage_memory(problem, *gap) < table.nbytes  # a stage between them does not hold it
    assert whole < without_table(0, n) + 2 * table.nbytes  # once, not once per reader


def test_an_int4_embedding_lookup_reads_the_rows_it_gathers_not_its_table(
    exports: Exports, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A decode step's ``GatherBlockQuantized`` reads one packed row with its scales and zero
    points, not the whole table (Qwen2.5-Coder-1.5B's first stage was predicted at 1.81x its
    measured time while its 117 MB packed embedding counted whole)."""
    from partitioner.analysis.roofline import unit_traffic

    export = converted(exports, "tiny-llama", "int4", tmp_path_factory)
    analysis = analyse(load_model(export / MODEL_FILE), dims={"batch": 1, "sequence": 1})
    index, order = analysis.index, analysis.frontier.order
    traffic = unit_traffic(index, analysis.frontier, analysis.table, analysis.units)
    [(unit, moved)] = [
        (u, t)
        for u, t in zip(analysis.units.units, traffic, strict=True)
        if any(index.nodes[n].op_type == "GatherBlockQuantized" for n in order[u.start : u.end])
    ]
    [gather] = [
        n for n in order[unit.start : unit.end] if index.nodes[n].op_type == "GatherBlockQuantized"
    ]
    tables = [name for name in index.node_inputs[gather] if name in index.initializers]
    table_bytes = sum(tensor_proto_bytes(index.initializers[name]) for name in tables)
    rows = int(index.initializers[tables[0]].dims[0])
    others = sum(
        tensor_proto_bytes(index.initializers[name]) for name in unit.initializers - set(tables)
    )
    assert len(tables) >= 2  # the packed data and its scales (and zero points)
    assert analysis.table.elements(index.node_inputs[gather][1]) == 1  # one token
    assert others < moved.weight_bytes <= others + table_bytes // rows + len(tables)
