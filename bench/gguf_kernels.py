"""Speed of each GGUF tensor type's ONNX Runtime mapping (partitioner.models.gguf.kernels).

For every type ``--weights keep`` maps, at 4096 x 4096 and at Qwen 1.5B's MLP down projection
(1536 outputs x 8960 inputs): a one-row and a 64-row product through the mapping, against a
float32 ``MatMul`` and against int4 ``MatMulNBits`` block 32 (``--weights int4``) of the same
weight, in the same run, round-robin, one intra-op thread, ``--rounds`` rounds of a few calls
each. Prints the best round's time and the ratios (the median over the rounds of the mapping's
time over float32's and over int4's in the same round, sound while other processes load the
CPU), the bits per weight ONNX Runtime holds by
:func:`~partitioner.models.gguf.kernels.stored_bytes` and as measured (resident memory the
session adds, after ``malloc_trim``), and writes them to ``bench/results/gguf_kernels.md``.

    .venv/bin/python bench/gguf_kernels.py [--rounds N] [--types Q4_K,Q6_K]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from partitioner.models.gguf import kernels  # noqa: E402

T = GGMLQuantizationType
RESULTS = REPO / "bench" / "results" / "gguf_kernels.md"
IQ = (T.IQ4_NL, T.IQ4_XS, T.IQ1_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S)
QUANTIZED = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
TYPES = (*QUANTIZED, *IQ, T.F16, T.F32)
SHAPES = ((4096, 4096), (1536, 8960))
ROWS = (1, 64)
CALLS = {1: 60, 64: 3}
F16_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
F16_OFFSETS.update(dict.fromkeys(IQ, (0,)))


def random_raw(ggml_type: GGMLQuantizationType, n_out: int, n_in: int) -> np.ndarray:
    """Random weights of ``ggml_type`` as GGUFReader gives them (K-quants: random bytes with
    sane f16 scales, any such bytes being a valid block)."""
    rng = np.random.default_rng(0)
    if ggml_type in F16_OFFSETS:
        per_block, nbytes = GGML_QUANT_SIZES[ggml_type]
        raw = rng.integers(0, 256, (n_out, n_in // per_block * nbytes), dtype=np.uint8)
        blocks = raw.reshape(-1, nbytes)
        for at in F16_OFFSETS[ggml_type]:
            d = rng.uniform(0.002, 0.02, blocks.shape[0]).astype(np.float16)
            blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
        return raw
    w = rng.standard_normal((n_out, n_in), dtype=np.float32) * np.float32(0.02)
    if ggml_type == T.F32:
        return w
    if ggml_type == T.F16:
        return w.astype(np.float16)
    result: np.ndarray = gguf_quantize(w, ggml_type)
    return result


def resident_mib() -> float:
    """This process's anonymous resident memory (Linux ``RssAnon``: not the page cache of
    mapped external data), after returning freed heap to the system."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    status = Path("/proc/self/status").read_text()
    kib = next(line.split()[1] for line in status.splitlines() if line.startswith("RssAnon:"))
    return int(kib) / 1024


def session(part: kernels.GraphPart, n_in: int) -> ort.InferenceSession:
    graph = helper.make_graph(
        list(part.nodes),
        "bench",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", n_in])],
        [helper.make_tensor_value_info(part.output, TensorProto.FLOAT, None)],
        initializer=list(part.initializers),
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    with tempfile.TemporaryDirectory(prefix="gguf-kernels-") as tmp:
        path = Path(tmp) / "model.onnx"  # external data, as segments are loaded
        onnx.save_model(model, str(path), save_as_external_data=True, location="model.data")
        del model, graph
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def timed(sess: ort.InferenceSession, x: np.ndarray) -> float:
    calls = CALLS[x.shape[0]]
    sess.run(None, {"x": x})
    start = time.perf_counter()
    for _ in range(calls):
        sess.run(None, {"x": x})
    return (time.perf_counter() - start) / calls


def measure(
    ggml_type: GGMLQuantizationType,
    shape: tuple[int, int],
    baselines: dict[str, ort.InferenceSession],
    rounds: int,
) -> dict[tuple[str, int], float]:
    """Seconds per call, per row count: the least over the rounds for the mapping and the
    baselines (keys ``(name, rows)``), and the median over the rounds of the mapping's time over
    each baseline's measured in the same round (keys ``("/f32", rows)``, ``("/int4", rows)``):
    the ratios stay sound while other processes load the CPU."""
    n_out, n_in = shape
    raw = random_raw(ggml_type, n_out, n_in)
    part = kernels.matmul("w", "x", raw, ggml_type, n_out, n_in)
    del raw
    x = np.random.default_rng(1).standard_normal((max(ROWS), n_in)).astype(np.float32)
    before = resident_mib()
    sessions = {"type": session(part, n_in)}
    sessions["type"].run(None, {"x": x[:1]})
    held = resident_mib() - before
    del part
    sessions.update(baselines)
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for rows in ROWS:
            for key, sess in sessions.items():
                samples.setdefault((key, rows), []).append(timed(sess, x[:rows]))
    times = {k: min(v) for k, v in samples.items()}
    for rows in ROWS:
        for base in ("f32", "int4"):
            pairs = zip(samples[("type", rows)], samples[(base, rows)], strict=True)
            times[(f"/{base}", rows)] = statistics.median(a / b for a, b in pairs)
    times[("held MiB", 0)] = held
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--types", default=",".join(t.name for t in TYPES))
    args = parser.parse_args()
    types = [GGMLQuantizationType[name] for name in args.types.split(",")]
    console = Console()
    table = Table(title="GGUF type mappings: ms per call (1 thread) and ratios")
    for col in (
        "shape",
        "type",
        "bits/w",
        "held",
        "1 row ms",
        "/f32",
        "/int4",
        "64 rows ms",
        "/f32",
        "/int4",
    ):
        table.add_column(col, justify="right")
    lines = [
        "# GGUF tensor types on ONNX Runtime kernels: speed",
        "",
        f"`.venv/bin/python bench/gguf_kernels.py --rounds {args.rounds}`; ONNX Runtime "
        f"{ort.__version__}, one intra-op thread, {args.rounds} rounds; ms: the best round. "
        "Ratios: the median over the rounds of the mapping's time over a float32 MatMul's and "
        "over int4 MatMulNBits b32's, measured in the same round (same weight). bits/w: what "
        "`stored_bytes` says ONNX Runtime holds per weight; held: the anonymous resident memory "
        "the session added, per weight, in bits (loaded from a file with external data, as "
        "segments are; measured).",
        "",
        "| shape | type | bits/w | held | 1 row ms | /f32 | /int4 | 64 rows ms | /f32 | /int4 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n_out, n_in in SHAPES:
        w = random_raw(T.F32, n_out, n_in)
        baselines = {
            "f32": session(kernels.matmul("f", "x", w, T.F32, n_out, n_in), n_in),
            "int4": session(kernels.matmul("q", "x", w, T.F32, n_out, n_in, "int4"), n_in),
        }
        del w
        for ggml_type in types:
            t = measure(ggml_type, (n_out, n_in), baselines, args.rounds)
            bits = kernels.stored_bytes(ggml_type, n_out, n_in) * 8 / (n_out * n_in)
            held = t[("held MiB", 0)] * 2**20 * 8 / (n_out * n_in)
            cells = [f"{n_out}x{n_in}", ggml_type.name, f"{bits:.1f}", f"{held:.1f}"]
            for rows in ROWS:
                ms = t[("type", rows)] * 1e3
                cells += [
                    f"{ms:.2f}",
                    f"{t[('/f32', rows)]:.2f}",
                    f"{t[('/int4', rows)]:.2f}",
                ]
            table.add_row(*cells)
            lines.append("| " + " | ".join(cells) + " |")
            console.print(f"{ggml_type.name} {n_out}x{n_in}: done")
        base = measure(T.F32, (n_out, n_in), baselines, args.rounds)
        lines.append(
            f"| {n_out}x{n_in} | (f32 / int4 baselines) | 32 / 6 | | "
            f"{base[('f32', 1)] * 1e3:.2f} / {base[('int4', 1)] * 1e3:.2f} | | | "
            f"{base[('f32', 64)] * 1e3:.2f} / {base[('int4', 64)] * 1e3:.2f} | | |"
        )
    console.print(table)
    RESULTS.write_text("\n".join(lines) + "\n")
    console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
