"""GGUF tensor types on ONNX Runtime's kernels (partitioner.models.gguf.kernels).

Each supported type: random blocks (gguf-py's quantizer for the legacy types; hand-written
K-quant and IQ4 blocks, any bytes with finite f16 scales), one-node graphs run by ONNX Runtime,
compared in float64 with ``x @ gguf.quants.dequantize(raw).T``. Tolerances, relative to the
row norms ``|x| |w|``: :data:`EXACT_TOL` at accuracy level 0 (float activations: the weights
are exact, only float32 rounding differs), :data:`INT8_ACT_TOL` at level 4 (activations
quantized to int8 per block by the kernel, as llama.cpp quantizes them). Gathers are bit-exact.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from onnx import TensorProto, helper

from partitioner.errors import GraphError
from partitioner.models.gguf import kernels, kernels_codes
from partitioner.models.gguf.kernels import GraphPart, UnsupportedTensorType

T = GGMLQuantizationType
LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
K_QUANTS += [T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S]
"""Built by hand (random bytes, sane f16 scales): gguf-py cannot quantize to them."""
FLOATS = [T.F32, T.F16, T.BF16]
SUPPORTED = LEGACY + K_QUANTS + FLOATS
EXACT_TOL = 1e-6
"""max |y - ref| / (|x| |w_row|) at accuracy level 0 and for float weights (measured at most
1.1e-7 over every type here, float32 rounding)."""
INT8_ACT_TOL = 5e-3
"""The same at accuracy level 4: int8 activations per block (one step of 1/127 of a block's
largest |x|); measured 4.6e-4 (Q4_K) to 1.3e-3 (Q5_1) on these random rows."""
F16_SCALE_OFFSETS = {
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    **dict.fromkeys([T.IQ4_NL, T.IQ4_XS, T.IQ1_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S], (0,)),
    **dict.fromkeys([T.IQ3_XXS, T.IQ3_S], (0,)),
    T.IQ1_M: (),
}
"""Byte offsets of each K-quant block's f16 ``d`` (and ``dmin``), from ggml-common.h."""


def random_raw(ggml_type: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A ``[rows, cols]`` tensor of ``ggml_type`` as GGUFReader gives it."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if ggml_type == T.F32:
        return w
    if ggml_type == T.F16:
        return w.astype(np.float16)
    if ggml_type in LEGACY or ggml_type == T.BF16:
        return gguf_quantize(w, ggml_type)
    _, nbytes = GGML_QUANT_SIZES[ggml_type]
    per_block = GGML_QUANT_SIZES[ggml_type][0]
    raw = rng.integers(0, 256, (rows, cols // per_block * nbytes), dtype=np.uint8)
    blocks = raw.reshape(-1, nbytes)
    for offset in F16_SCALE_OFFSETS[ggml_type]:
        d = rng.uniform(0.002, 0.02, blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(-1, 2)
    if ggml_type == T.IQ1_M:  # its f16 d is the top nibbles of its four scale words
        d = rng.uniform(0.002, 0.02, blocks.shape[0]).astype(np.float16).view(np.uint16)
        words = blocks[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        nibbles = (d[:, None] >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(0xF)
        blocks[:, 48:56] = (words | (nibbles << np.uint16(12))).view(np.uint8)
    return raw


def reference(raw: np.ndarray, ggml_type: GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    if ggml_type == T.F32:
        return raw.astype(np.float32)
    if ggml_type == T.F16:
        return raw.astype(np.float32)
    out: np.ndarray = gguf_dequantize(raw, ggml_type).reshape(rows, cols)
    return out


def session(part: GraphPart, inp: str, elem: int, shape: list[int | str]) -> ort.InferenceSession:
    graph = helper.make_graph(
        list(part.nodes),
        "g",
        [helper.make_tensor_value_info(inp, elem, shape)],
        [helper.make_tensor_value_info(part.output, TensorProto.FLOAT, None)],
        initializer=list(part.initializers),
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def relative_error(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> float:
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    norms = np.linalg.norm(x, axis=-1, keepdims=True) * np.linalg.norm(w, axis=-1)
    return float(np.max(np.abs(y - ref) / norms))


@pytest.mark.parametrize("ggml_type", SUPPORTED, ids=lambda t: t.name)
@pytest.mark.parametrize("n_in", [256, 512])
@pytest.mark.parametrize("level", [0, 4])
def test_matmul_matches_dequantized_product(
    ggml_type: GGMLQuantizationType, n_in: int, level: int
) -> None:
    n_out = 64
    raw = random_raw(ggml_type, n_out, n_in)
    w = reference(raw, ggml_type, n_out, n_in)
    part = kernels.matmul("w", "x", raw, ggml_type, n_out, n_in, accuracy_level=level)
    sess = session(part, "x", TensorProto.FLOAT, ["rows", n_in])
    x = np.random.default_rng(1).standard_normal((4, n_in)).astype(np.float32)
    for rows in (1, 4):
        (y,) = sess.run(None, {"x": x[:rows]})
        assert y.shape == (rows, n_out)
        tol = INT8_ACT_TOL if level == 4 and ggml_type not in FLOATS else EXACT_TOL
        assert relative_error(y, x[:rows], w) < tol


def test_three_dimensional_activations_keep_their_shape() -> None:
    raw = random_raw(T.Q4_K, 32, 256)
    part = kernels.matmul("w", "x", raw, T.Q4_K, 32, 256, accuracy_level=0)
    sess = session(part, "x", TensorProto.FLOAT, [1, "seq", 256])
    x = np.random.default_rng(2).standard_normal((1, 3, 256)).astype(np.float32)
    (y,) = sess.run(None, {"x": x})
    assert y.shape == (1, 3, 32)
    assert relative_error(y[0], x[0], reference(raw, T.Q4_K, 32, 256)) < EXACT_TOL


def row_exact(ggml_type: GGMLQuantizationType, level: int) -> bool:
    raw = random_raw(ggml_type, 64, 512, seed=3)
    part = kernels.matmul("w", "x", raw, ggml_type, 64, 512, accuracy_level=level)
    sess = session(part, "x", TensorProto.FLOAT, ["rows", 512])
    x = np.random.default_rng(4).standard_normal((5, 512)).astype(np.float32)
    (together,) = sess.run(None, {"x": x})
    alone = np.concatenate([sess.run(None, {"x": x[i : i + 1]})[0] for i in range(5)])
    return bool(np.array_equal(together, alone))


@pytest.mark.parametrize("ggml_type", LEGACY + K_QUANTS, ids=lambda t: t.name)
def test_quantized_rows_are_computed_alike_in_passes_of_any_size(
    ggml_type: GGMLQuantizationType,
) -> None:
    """A k-row pass gives bit for bit the rows of k one-row passes at accuracy level 4: the
    min term (its product padded to two rows) keeps MatMulNBits' row exactness. Level 0 is
    not row-exact (checked below); MatMulNBits at level 4 is on AVX-512 (not on AVX2, where the
    test is skipped: the plain Q4_0 kernel itself computes a lone row apart)."""
    if not row_exact(T.Q4_0, 4):
        pytest.skip("this CPU's MatMulNBits computes a lone row apart even without a min term")
    assert row_exact(ggml_type, 4)


def test_float_activations_are_not_row_exact() -> None:
    """Why the default is level 4 beyond speed: at level 0 a lone row adds in another order."""
    assert not row_exact(T.Q4_0, 0)


@pytest.mark.parametrize("ggml_type", SUPPORTED, ids=lambda t: t.name)
@pytest.mark.parametrize("n_cols", [256, 512])
def test_gather_is_bit_exact(ggml_type: GGMLQuantizationType, n_cols: int) -> None:
    n_rows = 40
    raw = random_raw(ggml_type, n_rows, n_cols, seed=5)
    table = reference(raw, ggml_type, n_rows, n_cols)
    part = kernels.gather("emb", "ids", raw, ggml_type, n_rows, n_cols)
    sess = session(part, "ids", TensorProto.INT64, [1, "seq"])
    ids = np.array([[0, 7, 39, 7, 12]], np.int64)
    (rows,) = sess.run(None, {"ids": ids})
    assert rows.dtype == np.float32
    assert np.array_equal(rows, table[ids])
    held = sum(onnx.numpy_helper.to_array(t).nbytes for t in part.initializers)
    assert held == kernels.stored_bytes(ggml_type, n_rows, n_cols, embedding=True)


@pytest.mark.parametrize("ggml_type", LEGACY + K_QUANTS, ids=lambda t: t.name)
def test_decoded_codes_are_gguf_values_bit_for_bit(ggml_type: GGMLQuantizationType) -> None:
    raw = random_raw(ggml_type, 8, 512, seed=7)
    decoded = kernels_codes.decode(raw, ggml_type, 8, 512)
    assert int(decoded.codes.max()) < 1 << decoded.layout.code_bits
    assert np.array_equal(kernels_codes.values(decoded), reference(raw, ggml_type, 8, 512))


def test_dequantize_is_gguf_dequantize() -> None:
    raw = random_raw(T.Q6_K, 8, 512)
    assert np.array_equal(kernels.dequantize(raw, T.Q6_K, (8, 512)), reference(raw, T.Q6_K, 8, 512))
    bf = random_raw(T.BF16, 4, 256)
    assert np.array_equal(kernels.dequantize(bf, T.BF16, (4, 256)), reference(bf, T.BF16, 4, 256))


@pytest.mark.parametrize("ggml_type", [T.TQ1_0, T.TQ2_0, T.MXFP4])
def test_unsupported_types_are_refused_by_name(ggml_type: GGMLQuantizationType) -> None:
    raw = np.zeros(GGML_QUANT_SIZES[ggml_type][1], np.uint8)
    with pytest.raises(UnsupportedTensorType, match=ggml_type.name):
        kernels.matmul("w", "x", raw, ggml_type, 1, 256)
    with pytest.raises(UnsupportedTensorType, match=ggml_type.name):
        kernels.gather("w", "x", raw, ggml_type, 1, 256)
    with pytest.raises(UnsupportedTensorType, match=ggml_type.name):
        kernels.stored_bytes(ggml_type, 1, 256)


@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q8_0, T.F16], ids=lambda t: t.name)
def test_requantized_weights_are_close(
    weights: kernels.WeightsMode, ggml_type: GGMLQuantizationType
) -> None:
    raw = random_raw(ggml_type, 64, 512)
    w = reference(raw, ggml_type, 64, 512)
    part = kernels.matmul("w", "x", raw, ggml_type, 64, 512, weights)
    x = np.random.default_rng(6).standard_normal((4, 512)).astype(np.float32)
    (y,) = session(part, "x", TensorProto.FLOAT, ["rows", 512]).run(None, {"x": x})
    assert relative_error(y, x, w) < (3e-2 if weights == "int4" else INT8_ACT_TOL)  # 1.1e-2, 1e-3
    emb = kernels.gather("e", "ids", raw, ggml_type, 64, 512, weights)
    ids = np.array([3, 63], np.int64)
    (rows,) = session(emb, "ids", TensorProto.INT64, [2]).run(None, {"ids": ids})
    step = np.abs(w[ids]).max() / (7 if weights == "int4" else 127)
    assert np.abs(rows - w[ids]).max() <= step


def test_requantized_embedding_needs_whole_blocks() -> None:
    raw = random_raw(T.F32, 4, 48)
    with pytest.raises(GraphError, match="48 values"):
        kernels.gather("e", "ids", raw, T.F32, 4, 48, "int8")


@pytest.mark.parametrize("weights", ["keep", "int4", "int8"])
def test_nbits_nodes_are_on_the_fast_path(weights: kernels.WeightsMode) -> None:
    """Speed guard: no float zero point (it stops pre-packing, ~40x slower) and every
    MatMulNBits at accuracy level 4 (8-bit weights have no other fast CPU path)."""
    for ggml_type in LEGACY + K_QUANTS:
        part = kernels.matmul("w", "x", random_raw(ggml_type, 16, 256), ggml_type, 16, 256, weights)
        inits = {t.name: t for t in part.initializers}
        nbits = [n for n in part.nodes if n.op_type == "MatMulNBits"]
        assert len(nbits) == 1
        node = nbits[0]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["accuracy_level"] == 4
        if weights == "keep":
            assert len(node.input) == 3  # default zero point: no zero-point input at all
        else:
            assert inits[node.input[3]].data_type == TensorProto.UINT8
        expected = kernels.stored_bytes(ggml_type, 16, 256, weights)
        held = sum(onnx.numpy_helper.to_array(t).nbytes for t in part.initializers)
        block_sums = 16 * 256 // attrs["block_size"] * 4  # what pre-packing adds, float32
        assert held + block_sums == expected
