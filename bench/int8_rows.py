"""int8 activations per pass against per row, on Gemma 3 270M: what row exactness costs.

``quantize_dynamic`` quantizes a ``MatMulInteger``'s activations with one scale per pass, so a
token decodes differently alone and in a speculative verify pass; ``fedshard export --weights
int8`` quantizes them per row instead (:mod:`partitioner.models.decoders.int8rows`). Both graphs are
made here from the cached float32 export (the demo's), side by side in one run:

- whether a token decodes bit for bit alike alone and in a two-token pass;
- quality against float32 (:func:`partitioner.models.decoders.quality.compare_decoders`: top-1
  agreement and perplexity on 128 tokens of real text, one token a step);
- the whole model in one ONNX Runtime session: a one-token step and a 4-token pass, at one
  and two threads, timed round-robin (median of ``--rounds`` rounds of 8 calls each).

    .venv/bin/python bench/int8_rows.py [--rounds N]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

import onnx  # noqa: E402
from report.headlines import Headline, write_headlines  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import track  # noqa: E402
from rich.table import Table  # noqa: E402

from partitioner.analysis.modelio import save_model  # noqa: E402
from partitioner.models.decoders.int8rows import per_row_activations  # noqa: E402
from partitioner.models.decoders.ort_runner import OrtDecoder  # noqa: E402
from partitioner.models.decoders.precision import per_pass_int8  # noqa: E402
from partitioner.models.decoders.quality import compare_decoders, evaluation_ids  # noqa: E402
from partitioner.models.decoders.rowwise import rows_decode_alike, two_row_products  # noqa: E402

RESULTS = REPO / "bench" / "results" / "int8_rows.md"
CACHE = REPO / ".cache" / "fedshard"
VARIANTS = ("per pass", "per row")
PASSES = (1, 4)
THREADS = (1, 2)
CALLS = 8


def build(source: Path, out: Path) -> dict[str, Path]:
    """Both int8 graphs of the float32 export ``source``, in ``out``."""
    dirs = {v: out / v.replace(" ", "-") for v in VARIANTS}
    for d in dirs.values():
        shutil.copytree(source, d, ignore=shutil.ignore_patterns("model.onnx*"))
    per_pass = per_pass_int8(onnx.load(str(source / "model.onnx"), load_external_data=True))
    save_model(per_pass, dirs["per pass"] / "model.onnx")
    per_row = two_row_products(per_row_activations(per_pass))  # what quantize_model writes
    save_model(per_row, dirs["per row"] / "model.onnx")
    return dirs


def step_times(
    dirs: dict[str, Path], ids: list[int], rounds: int
) -> dict[tuple[str, int, int], float]:
    """Median seconds of a pass of ``k`` tokens after a 32-token prefill, per variant and
    thread count, round-robin."""
    times: dict[tuple[str, int, int], list[float]] = {}
    for threads in THREADS:
        decoders = {v: OrtDecoder(d, threads=threads) for v, d in dirs.items()}
        for _ in track(range(rounds), description=f"timing passes, {threads} thread(s)"):
            for v, decoder in decoders.items():
                for k in PASSES:
                    decoder.prefill(ids[:32])
                    start, at = time.perf_counter(), 32
                    for _ in range(CALLS):
                        decoder.step(ids[at : at + k])
                        at += k
                    times.setdefault((v, threads, k), []).append(
                        (time.perf_counter() - start) / CALLS
                    )
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    from partitioner.models.frontdoor import float32_export

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    console = Console()
    source = float32_export("gemma3-270m", CACHE)
    with tempfile.TemporaryDirectory(prefix="fedshard-int8-rows-") as tmp:
        dirs = build(source, Path(tmp))
        alike = {v: rows_decode_alike(d) for v, d in dirs.items()}
        quality = {v: compare_decoders(source, d) for v, d in dirs.items()}
        times = step_times(dirs, evaluation_ids(source)[:96], args.rounds)
    table = Table(title=f"Gemma 3 270M int8, one session, median of {args.rounds} rounds")
    for column in ("activations", "alike alone / in a pass", "top-1 vs fp32", "perplexity"):
        table.add_column(column)
    for threads in THREADS:
        for k in PASSES:
            table.add_column(f"{k}-token pass, {threads} thr (ms)", justify="right")
    rows = []
    for v in VARIANTS:
        cells = [
            v,
            "yes" if alike[v] else "no",
            f"{quality[v].top1_agreement:.1%}",
            f"{quality[v].perplexity:.2f} (fp32 {quality[v].reference_perplexity:.2f})",
            *(f"{times[v, t, k] * 1e3:.2f}" for t in THREADS for k in PASSES),
        ]
        table.add_row(*cells)
        rows.append("| " + " | ".join(cells) + " |")
    console.print(table)
    ratios = {
        (t, k): times["per row", t, k] / times["per pass", t, k] for t in THREADS for k in PASSES
    }
    verify = {t: times["per row", t, 4] / times["per row", t, 1] for t in THREADS}
    lines = [
        f"per row / per pass, {k}-token pass, {t} thread(s): {r:.3f}x"
        for (t, k), r in ratios.items()
    ]
    lines += [
        f"per row: a 4-token pass / a one-token step, {t} thread(s): {r:.2f}x"
        for t, r in verify.items()
    ]
    for line in lines:
        console.print(line)
    header = " | ".join(f"{k}-token pass, {t} thread(s), ms" for t in THREADS for k in PASSES)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        f"# Gemma 3 270M int8: activations per pass against per row (median of {args.rounds})\n\n"
        f"| activations | alike alone / in a pass | top-1 vs fp32 | perplexity | {header} |\n"
        f"|{'---|' * (4 + len(THREADS) * len(PASSES))}\n"
        + "\n".join(rows)
        + "\n\n"
        + "\n".join(f"- {line}" for line in lines)
        + "\n"
    )
    write_headlines(
        "int8_rows",
        [
            *(
                Headline(f"per row / per pass, one-token step, {t} thread(s)", ratios[t, 1], "x")
                for t in THREADS
            ),
            *(
                Headline(f"per row: 4-token pass / one-token step, {t} thread(s)", verify[t], "x")
                for t in THREADS
            ),
        ],
    )


if __name__ == "__main__":
    main()
