"""What one pass over r tokens costs against r passes over one: the premise of speculative decoding.

Speculative decoding pays when a stage that checks k drafted tokens in one pass reads its weights
once, not k times: a decode step bound by reading weights then costs about the same at k + 1
rows as at one. This measures that premise for one weight matrix of Qwen2.5-Coder-1.5B's MLP
(1536 x 8960), one ONNX Runtime thread as the agents run, in each precision fedshard exports:
float32 ``MatMul``, int8 ``DynamicQuantizeLinear`` + ``MatMulInteger`` (``quantize_dynamic``)
and int4 ``MatMulNBits`` (``MatMulNBitsQuantizer``) at ``accuracy_level`` 4 (int8 activations,
what ``fedshard export`` writes) and 0 (weights unpacked to float32, the quantizer's default).
The precisions and row counts are timed round-robin in one run (best of the rounds), so load on
the machine hits them alike.

    .venv/bin/python bench/verify_rows.py [--rounds N]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from report.headlines import Headline, write_headlines
from rich.console import Console
from rich.progress import track
from rich.table import Table

RESULTS = Path(__file__).parent / "results" / "verify_rows.md"
K, N = 1536, 8960
ROWS = (1, 2, 4, 8, 64)
PRECISIONS = ("fp32", "int8", "int4", "int4 (level 0)")
CALLS = 5


def matmul_model() -> onnx.ModelProto:
    """``y = x @ W`` with a ``[K, N]`` float32 weight and ``rows`` symbolic."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(
        (rng.standard_normal((K, N), dtype=np.float32) / K**0.5).astype(np.float32), "w"
    )
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "verify_rows",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", N])],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def quantized(precision: str, directory: Path) -> bytes:
    """The model in ``precision``, with ONNX Runtime's own quantizers."""
    model = matmul_model()
    if precision == "int4":
        return quantized_nbits(model, 4)
    if precision == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        source, target = directory / "fp32.onnx", directory / "int8.onnx"
        onnx.save(model, str(source))
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8)
        return target.read_bytes()
    if precision == "int4 (level 0)":
        return quantized_nbits(model, 0)
    return bytes(model.SerializeToString())


def quantized_nbits(model: onnx.ModelProto, accuracy_level: int) -> bytes:
    """``MatMulNBitsQuantizer``'s 4-bit model (blocks of 32, zero points) at ``accuracy_level``
    (4, what ``fedshard export`` writes: int8 activations; 0: weights unpacked to float32)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        model, block_size=32, is_symmetric=False, accuracy_level=accuracy_level
    )
    quantizer.process()
    return bytes(quantizer.model.model.SerializeToString())


def session(model: bytes) -> Any:
    """One intra-op thread, as the agents run their segments."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def timed(run: Any, feeds: dict[str, np.ndarray]) -> float:
    """Seconds of one call: the smaller of wall and CPU time, over :data:`CALLS` calls."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(CALLS):
        run(None, feeds)
    return min(time.perf_counter() - start, time.process_time() - cpu) / CALLS


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    inputs = {r: {"x": rng.standard_normal((r, K), dtype=np.float32)} for r in ROWS}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {p: session(quantized(p, Path(tmp))).run for p in PRECISIONS}
    for p in PRECISIONS:
        for r in ROWS:
            runs[p](None, inputs[r])  # arenas and pre-packing settled before timing
    best = {(p, r): float("inf") for p in PRECISIONS for r in ROWS}
    for _ in track(range(args.rounds), description="timing every precision at every row count"):
        for p in PRECISIONS:
            for r in ROWS:
                best[p, r] = min(best[p, r], timed(runs[p], inputs[r]))
    report(best, args.rounds)


def report(best: dict[tuple[str, int], float], rounds: int) -> None:
    """Print the table and ratios; write the results file and headlines."""
    table = Table(title=f"one {K} x {N} product, one thread, best of {rounds} rounds")
    table.add_column("precision")
    for r in ROWS:
        table.add_column(f"{r} row{'s' if r > 1 else ''}: ms (x one row)", justify="right")
    table.add_column("one-row GFLOP/s", justify="right")
    lines = []
    for p in PRECISIONS:
        one = best[p, 1]
        cells = [f"{best[p, r] * 1e3:.2f} ({best[p, r] / one:.2f}x)" for r in ROWS]
        gflops = f"{2 * K * N / one / 1e9:.1f}"
        table.add_row(p, *cells, gflops)
        lines.append(f"| {p} | {' | '.join(cells)} | {gflops} |")
    console = Console()
    console.print(table)
    console.print(
        "a pass of r rows against one row: near 1x means verifying r - 1 drafted tokens is "
        "almost free (the step reads its weights once); near r means it costs r steps"
    )
    header = " | ".join(f"{r} rows ms (x one row)" for r in ROWS)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        f"# One pass over r rows against one row ({K} x {N}, one thread, best of {rounds})\n\n"
        f"| precision | {header} | one-row GFLOP/s |\n|{'---|' * (len(ROWS) + 2)}\n"
        + "\n".join(lines)
        + "\n"
    )
    write_headlines(
        "verify_rows",
        [
            *(
                Headline(f"{p}: a pass of 4 rows against one row", best[p, 4] / best[p, 1], "x")
                for p in PRECISIONS
            ),
            Headline(
                "int4 one row: accuracy level 4 against 0 (time)",
                best["int4", 1] / best["int4 (level 0)", 1],
                "x",
            ),
        ],
    )


if __name__ == "__main__":
    main()
