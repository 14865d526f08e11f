"""The GGUF segment builder against the numpy reference, on small random GGUF files.

Per architecture, a file with float32 weights (tight tolerance) and one with a quantized mix
(every type the builder keeps is in some mix), served whole and split; prefill of 5 tokens then
2 one-token steps, each step's presents fed back as pasts. Also: the unit table against a
brute-force count of the tensor list, typed refusals, and write_segment's memory.
"""

from __future__ import annotations

import itertools
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, RopeScalingType

from devtools.gguf_files import MIXES, SPECS, Spec, tensor_list, write_gguf
from partitioner.models.gguf import kernels, reference
from partitioner.models.gguf.archs import row_chunks
from partitioner.models.gguf.builder import (
    GgufSource,
    SegmentRange,
    build_segment,
    in_memory,
    write_segment,
)
from partitioner.models.gguf.header import UnsupportedModel, read_header
from partitioner.models.gguf.reader import GgufFile, GgufFormatError
from partitioner.models.gguf.units import (
    OPS_BASE,
    block_ops,
    segment_range,
    tensor_stored_bytes,
    unit_table,
)

T = GGMLQuantizationType
TOKENS = [5, 17, 256, 99, 3, 42, 7]
STEPS = [5, 1, 1]
"""Prefill 5 tokens, then two one-token decode steps."""
QUANT_MIX = {"llama": "q4_k_m", "qwen2": "legacy", "qwen3": "kquants", "gemma3": "q4_k_m"}
QUANT_MIX["phi3"] = "floats"
FLOAT_TOL = 2e-5
"""max |logit - reference| / max |reference logit| with float weights: float32 against float64
(measured at most 1.1e-6)."""
QUANT_TOL = 0.1
"""The same with quantized weights at ``MatMulNBits``' accuracy level 4, which quantizes the
activations to int8 per block as llama.cpp does: random models amplify that rounding (measured
4e-4 to 5e-2 over these files). At accuracy level 0 (float activations) quantized weights are
held to :data:`FLOAT_TOL`: the weights themselves are exact (measured at most 6.7e-7)."""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch, spec in SPECS.items():
        for mix in ("f32", QUANT_MIX[arch]):
            out[arch, mix] = write_gguf(root / f"{arch}-{mix}.gguf", spec, mix, seed=1)
    return out


def _session(proto: onnx.ModelProto | Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    model = str(proto) if isinstance(proto, Path) else proto.SerializeToString()
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _stages(source: GgufSource, cuts: Sequence[int], level: int = 4) -> list[ort.InferenceSession]:
    return [
        _session(
            build_segment(
                source, segment_range(source.model, a, b), in_memory, accuracy_level=level
            )
        )
        for a, b in itertools.pairwise(cuts)
    ]


def _generate(
    sessions: list[ort.InferenceSession], source: GgufSource
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Runs the chain over :data:`STEPS`; per position: (top logits, top ids)."""
    m = source.model
    empty = np.zeros((1, m.kv_heads, 0, m.head_dim), np.float32)
    state = {f"past.{i}.{k}": empty for i in range(m.layers) for k in ("key", "value")}
    pos = 0
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    for q in STEPS:
        pool: dict[str, np.ndarray] = {
            "input_ids": np.array([TOKENS[pos : pos + q]], np.int64),
            "attention_mask": np.ones((1, pos + q), np.int64),
            "position_ids": np.arange(pos, pos + q, dtype=np.int64)[None],
            **state,
        }
        for sess in sessions:
            feeds = {i.name: pool[i.name] for i in sess.get_inputs()}
            names = [o.name for o in sess.get_outputs()]
            pool |= dict(zip(names, sess.run(None, feeds), strict=True))
        logits, ids = pool["trailing_top_logits"][0], pool["trailing_top_ids"][0]
        assert np.array_equal(pool["top_logits"][0], logits[-1])
        rows += [(logits[j], ids[j]) for j in range(q)]
        state = {k.replace("present", "past"): v for k, v in pool.items() if "present" in k}
        assert state["past.0.key"].shape[2] == pos + q
        pos += q
    return rows


def _check(rows: list[tuple[np.ndarray, np.ndarray]], ref: np.ndarray, tol: float) -> float:
    worst = 0.0
    for (logits, ids), r in zip(rows, ref, strict=True):
        scale = float(np.abs(r).max())
        worst = max(worst, float(np.abs(logits - r[ids]).max()) / scale)
        order = np.argsort(-r)
        if r[order[0]] - r[order[1]] > 2 * tol * scale:
            assert ids[0] == order[0]
        assert list(ids[:10]) == sorted(ids[:10], key=lambda t: -logits[list(ids).index(t)])
    assert worst <= tol
    return worst


@pytest.mark.parametrize("arch", sorted(SPECS))
@pytest.mark.parametrize(
    ("quantized", "level"), [(False, 4), (True, 0), (True, 4)], ids=["f32", "exact", "int8act"]
)
def test_whole_and_split_match_the_reference(
    files: dict[tuple[str, str], Path], arch: str, quantized: bool, level: int
) -> None:
    mix = QUANT_MIX[arch] if quantized else "f32"
    source = GgufSource(files[arch, mix])
    m = source.model
    ref = reference.forward(m, reference.dequantized(m, source.raw), TOKENS)
    tol = QUANT_TOL if quantized and level == 4 and mix != "floats" else FLOAT_TOL
    units = m.layers + 2
    whole = _generate(_stages(source, [0, units], level), source)
    _check(whole, ref, tol)
    split = _generate(_stages(source, [0, 1 + m.layers // 2, units], level), source)
    _check(split, ref, tol)
    for (a, ids_a), (b, ids_b) in zip(whole, split, strict=True):
        np.testing.assert_array_equal(ids_a[:1], ids_b[:1])
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(a).max()))


@pytest.mark.parametrize(
    "spec",
    [
        Spec("llama", rope_freqs=True),
        Spec("gemma3", layers=2, kv_heads=1, head_dim=128, tied=True, sliding_window=3,
             extra={"{arch}.final_logit_softcapping": 100.0}),
    ],
    ids=["llama3-rope-freqs", "gemma-softcap"],
)  # fmt: skip
def test_rope_factors_and_softcap_match_the_reference(tmp_path: Path, spec: Spec) -> None:
    source = GgufSource(write_gguf(tmp_path / "m.gguf", spec, "f32"))
    m = source.model
    assert ("rope_freqs.weight" in m.tensors) == spec.rope_freqs
    assert m.final_softcap == spec.extra.get("{arch}.final_logit_softcapping")
    ref = reference.forward(m, reference.dequantized(m, source.raw), TOKENS)
    _check(_generate(_stages(source, [0, 2, m.layers + 2]), source), ref, FLOAT_TOL)
    if m.final_softcap is not None:
        assert np.abs(ref).max() < m.final_softcap


@pytest.mark.parametrize("mix", ["q4_k_m", "legacy", "kquants", "floats"])
def test_weights_in_pieces_change_nothing(tmp_path: Path, mix: str) -> None:
    # accuracy level 0: at level 4 MatMulNBits' rounding depends on N (pieces of kquants
    # differ by 2e-4, amplified by the random layers), at level 0 pieces agree to 7e-7
    source = GgufSource(write_gguf(tmp_path / "m.gguf", SPECS["llama"], mix))
    span = SegmentRange(0, source.model.layers, True, True)
    assert len(row_chunks(300, 256, 20_000)) == 4
    pieces = build_segment(source, span, in_memory, chunk_values=20_000, accuracy_level=0)
    names = {t.name for t in pieces.graph.initializer}
    assert {"output.3.qweight", "token_embd.3.qweight"} & names or mix == "floats"
    assert any(n.startswith("blk.0.ffn_down.6.") for n in names)  # 256 x 512 in 7 pieces
    whole = _generate([_session(build_segment(source, span, in_memory, accuracy_level=0))], source)
    cut = _generate([_session(pieces)], source)
    for (a, ids_a), (b, ids_b) in zip(whole, cut, strict=True):
        np.testing.assert_array_equal(ids_a[:1], ids_b[:1])
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(a).max()))


def test_embedding_and_head_alone_are_stages(files: dict[tuple[str, str], Path]) -> None:
    source = GgufSource(files["gemma3", "q4_k_m"])
    m = source.model
    units = m.layers + 2
    chained = _generate(_stages(source, [0, 1, 3, units - 1, units]), source)
    whole = _generate(_stages(source, [0, units]), source)
    for (a, ids_a), (b, ids_b) in zip(whole, chained, strict=True):
        np.testing.assert_array_equal(ids_a[:1], ids_b[:1])
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(a).max()))


def test_segment_names_follow_the_contract(files: dict[tuple[str, str], Path]) -> None:
    source = GgufSource(files["llama", "f32"])
    first = build_segment(source, SegmentRange(0, 1, True, False), in_memory)
    middle = build_segment(source, SegmentRange(1, 2, False, False), in_memory)
    last = build_segment(source, SegmentRange(2, 3, False, True), in_memory)
    kv = ["past.{i}.key", "past.{i}.value"]
    assert [i.name for i in first.graph.input] == [
        "input_ids", "attention_mask", "position_ids", *(k.format(i=0) for k in kv)
    ]  # fmt: skip
    assert [o.name for o in first.graph.output] == ["hidden.1", "present.0.key", "present.0.value"]
    assert middle.graph.input[0].name == "hidden.1"
    assert middle.graph.output[0].name == "hidden.2"
    assert [o.name for o in last.graph.output][:4] == [
        "top_logits", "top_ids", "trailing_top_logits", "trailing_top_ids"
    ]  # fmt: skip
    assert not any(t.name.startswith("blk.0") for t in last.graph.initializer)


def test_written_segment_equals_the_built_one(
    files: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    source = GgufSource(files["qwen3", "kquants"])
    span = SegmentRange(0, 2, True, True)
    paths = write_segment(tmp_path / "seg.onnx", source, span)
    assert paths[1].stat().st_size > paths[0].stat().st_size
    assert onnx.load(str(paths[0]), load_external_data=False).ByteSize() < 100_000
    on_disk = _generate([_session(paths[0])], source)
    in_mem = _generate([_session(build_segment(source, span, in_memory))], source)
    for (a, ids_a), (b, ids_b) in zip(on_disk, in_mem, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ids_a, ids_b)


def _peak_bytes(path: Path, out: Path) -> int:
    source = GgufSource(path)
    tracemalloc.start()
    write_segment(out, source, SegmentRange(0, 1, True, False))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_write_segment_memory_does_not_grow_with_other_layers(tmp_path: Path) -> None:
    small = Spec("llama", layers=2, hidden=512, heads=8, kv_heads=4, ffn=1536)
    big = Spec("llama", layers=12, hidden=512, heads=8, kv_heads=4, ffn=1536)
    a = write_gguf(tmp_path / "a.gguf", small, "q4_k_m")
    b = write_gguf(tmp_path / "b.gguf", big, "q4_k_m")
    assert b.stat().st_size > 4 * a.stat().st_size
    peak_a = _peak_bytes(a, tmp_path / "a.onnx")
    peak_b = _peak_bytes(b, tmp_path / "b.onnx")
    largest = 512 * 1536 * 4  # one FFN matrix as float32
    assert peak_b <= peak_a * 1.1 + 64 * 1024
    assert peak_b < 4 * largest


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_unit_table_counts_the_tensor_list(files: dict[tuple[str, str], Path], arch: str) -> None:
    spec = SPECS[arch]
    path = files[arch, QUANT_MIX[arch]]
    model = read_header(path)
    table = unit_table(model, context=100)
    blocks = [f"blk.{i}" for i in range(spec.layers)]
    assert [u.name for u in table] == ["embedding", *blocks, "head"]
    listed = {name: shape for name, _, shape in tensor_list(spec)}
    assert set(listed) == set(model.tensors)
    assert sum(u.file_bytes for u in table) == sum(t.n_bytes for t in model.tensors.values())
    for i in range(spec.layers):
        names = [n for n in listed if n.startswith(f"blk.{i}.")]
        unit = table[i + 1]
        expect = sum(tensor_stored_bytes(model.tensors[n], "keep") for n in names)
        assert unit.weight_bytes == expect
        macs = sum(int(np.prod(listed[n])) for n in names if len(listed[n]) == 2)
        assert unit.prefill.flops >= 2 * macs * 64
        assert unit.decode.flops >= 2 * macs
        assert unit.kv_bytes_per_token == 2 * spec.kv_heads * spec.head_dim * 4
        assert unit.decode.bytes_read >= expect + unit.kv_bytes_per_token * 100
    embd = model.tensors["token_embd.weight"]
    assert table[0].weight_bytes == kernels.stored_bytes(
        embd.type, spec.vocab, spec.hidden, embedding=True
    )
    out = model.tensors[model.output_tensor]
    head = kernels.stored_bytes(out.type, spec.vocab, spec.hidden)
    assert table[-1].weight_bytes == head + 4 * spec.hidden


@pytest.mark.parametrize("arch", sorted(SPECS))
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_block_ops_count_the_built_nodes(tmp_path: Path, arch: str, mix: str) -> None:
    source = GgufSource(write_gguf(tmp_path / "m.gguf", SPECS[arch], mix))
    proto = build_segment(source, SegmentRange(1, 2, False, False), in_memory)
    built = sum(n.op_type != "Constant" for n in proto.graph.node)
    matrices = [t for t in source.model.layer_tensors(1) if len(t.shape) == 2]
    assert block_ops(source.model, matrices, "keep") == built
    assert OPS_BASE[source.model.architecture] <= built


def test_segment_ranges_cover_units(files: dict[tuple[str, str], Path]) -> None:
    model = read_header(files["llama", "f32"])
    assert segment_range(model, 0, 1) == SegmentRange(0, 0, True, False)
    assert segment_range(model, 1, 3) == SegmentRange(0, 2, False, False)
    assert segment_range(model, 3, 5) == SegmentRange(2, 3, False, True)


def _refusal(tmp_path: Path, **kwargs: object) -> UnsupportedModel:
    path = tmp_path / "bad.gguf"
    write_gguf(path, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedModel) as info:
        read_header(path)
    return info.value


def test_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    error = _refusal(tmp_path, spec=Spec("mamba"), mix="f32")
    assert error.reason == "architecture"
    assert error.detail == "mamba"
    assert "mamba" in str(error)


def test_unsupported_tensor_type_is_refused_by_name(tmp_path: Path) -> None:
    mix = {"default": T.F32, "ffn_down": T.TQ1_0}
    error = _refusal(tmp_path, spec=SPECS["llama"], mix=mix)
    assert error.reason == "tensor_type"
    assert error.detail == "TQ1_0"
    assert "blk.0.ffn_down.weight" in str(error)


def test_unsupported_rope_scaling_is_refused_by_name(tmp_path: Path) -> None:
    def yarn(writer: GGUFWriter) -> None:
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)

    error = _refusal(tmp_path, spec=SPECS["qwen2"], mix="f32", metadata=yarn)
    assert error.reason == "rope_scaling"
    assert error.detail == "yarn"


def test_header_reads_the_file_facts(files: dict[tuple[str, str], Path]) -> None:
    model = read_header(files["gemma3", "q4_k_m"])
    assert model.name == "tiny-gemma3"
    assert (model.layers, model.hidden, model.heads, model.kv_heads) == (6, 256, 4, 1)
    assert (model.head_dim, model.ffn, model.vocab) == (128, 512, 300)
    assert model.tied_embeddings
    assert model.sliding_window == 4
    assert [model.sliding(i) for i in range(6)] == [True] * 5 + [False]
    assert model.rope_layout == "neox"
    assert model.quantization["Q6_K"].count == 12
    assert model.bos_token_id == 256
    assert model.eos_token_ids == (257,)
    assert model.chat_template is not None
    assert read_header(files["llama", "f32"]).rope_layout == "pairs"


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_lean_reader_gives_gguf_readers_data(tmp_path: Path, mix: str) -> None:
    path = write_gguf(tmp_path / "m.gguf", SPECS["qwen2"], mix)
    theirs = GGUFReader(str(path))
    ours = GgufFile(path)
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        data = ours.data(t.name)
        assert data.shape == t.data.shape
        assert data.dtype == t.data.dtype or (data.dtype == np.uint8 and t.tensor_type == T.BF16)
        assert data.tobytes() == t.data.tobytes()
    assert ours.metadata["tokenizer.ggml.tokens.count"] == SPECS["qwen2"].vocab
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        assert ours.array(key) == theirs.fields[key].contents()
    assert ours.array("tokenizer.ggml.scores") is None
    assert ours.metadata["general.architecture"] == "qwen2"


def test_non_gguf_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\x08\x07" + bytes(100))
    with pytest.raises(GgufFormatError, match="not a GGUF file"):
        GgufFile(path)


def test_a_batch_of_sequences_is_each_sequence_alone(files: dict[tuple[str, str], Path]) -> None:
    source = GgufSource(files["gemma3", "f32"])
    m = source.model
    sess = _session(build_segment(source, SegmentRange(0, m.layers, True, True), in_memory))
    batch = np.array([TOKENS[:5], TOKENS[2:7]], np.int64)

    def run(ids: np.ndarray) -> np.ndarray:
        empty = np.zeros((ids.shape[0], m.kv_heads, 0, m.head_dim), np.float32)
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones_like(ids),
            "position_ids": np.tile(np.arange(ids.shape[1], dtype=np.int64), (ids.shape[0], 1)),
            **{f"past.{i}.{k}": empty for i in range(m.layers) for k in ("key", "value")},
        }
        out: np.ndarray = sess.run(["trailing_top_logits"], feeds)[0]
        return out

    together = run(batch)
    for row in range(2):
        alone = run(batch[row : row + 1])
        np.testing.assert_allclose(together[row], alone[0], rtol=0, atol=1e-5)
