"""What exact speculation costs a float32 decoder: its products as exported, on at least two rows
(what ``fedshard export`` writes), and on every row stacked twice (int4's construction).

A one-row float ``MatMul`` adds in another order than a pass of several rows, so a token
decodes differently alone and in a speculative verify pass
(:mod:`partitioner.models.decoders.rowwise`). The three graphs are made here from one float32
export, side by side in one run, and each is:

- probed (:func:`~partitioner.models.decoders.rowwise.rows_decode_alike`: passes of 2 to 8
  tokens against one-token steps, bit for bit);
- timed in one ONNX Runtime session, round-robin: a one-token step after a 64-token prompt, an
  8-token verify pass there, and the 64-token prefill (median of ``--rounds`` rounds).

    .venv/bin/python bench/float_rows.py [EXPORT_DIR] [--rounds N] [--threads T]

EXPORT_DIR defaults to the cached float32 Gemma 3 270M export (``.cache/fedshard/exports``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

import onnx  # noqa: E402

from partitioner.analysis.modelio import save_model  # noqa: E402
from partitioner.models.decoders.ort_runner import OrtDecoder  # noqa: E402
from partitioner.models.decoders.rowwise import (  # noqa: E402
    at_least_two_rows,
    rows_decode_alike,
    two_row_products,
    without_row_padding,
)

DEFAULT = REPO / ".cache" / "fedshard" / "exports" / "gemma3-270m-top64-trailing-fp32"
PROMPT = list(range(100, 164))
VARIANTS: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]] = {
    "as exported": lambda m: m,
    "at least two rows": lambda m: at_least_two_rows(m, weight_products=True),
    "two rows stacked": two_row_products,
}


def build(source: Path, out: Path) -> dict[str, Path]:
    """The three graphs of the float32 export ``source``, in ``out``."""
    dirs = {}
    for name, rewrite in VARIANTS.items():
        target = out / name.replace(" ", "-")
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("model.onnx*"))
        model = without_row_padding(onnx.load(str(source / "model.onnx"), load_external_data=True))
        save_model(rewrite(model), target / "model.onnx")
        dirs[name] = target
    return dirs


def timings(decoder: OrtDecoder) -> tuple[float, float, float]:
    """Seconds of a one-token step, an 8-token pass and the prefill, after :data:`PROMPT`."""
    start = time.perf_counter()
    first = decoder.prefill(PROMPT)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    decoder.decode(first.token)
    step = time.perf_counter() - start
    decoder.prefill(PROMPT)
    start = time.perf_counter()
    decoder.step([first.token] * 8)
    return step, time.perf_counter() - start, prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", nargs="?", type=Path, default=DEFAULT)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedshard-float-rows-") as tmp:
        dirs = build(args.export, Path(tmp))
        alike = {name: rows_decode_alike(d) for name, d in dirs.items()}
        decoders = {name: OrtDecoder(d, threads=args.threads) for name, d in dirs.items()}
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in dirs}
        for _ in range(args.rounds):
            for name, decoder in decoders.items():
                runs[name].append(timings(decoder))
    base = [statistics.median(r[i] for r in runs["as exported"]) for i in range(3)]
    print(f"{args.export.name}, {args.threads} thread(s), median of {args.rounds} rounds")
    print(f"{'graph':20} {'rows alike':>10} {'step ms':>14} {'8-pass ms':>14} {'prefill ms':>14}")
    for name, values in runs.items():
        cells = []
        for i in range(3):
            median = statistics.median(v[i] for v in values)
            cells.append(f"{median * 1e3:7.2f} {median / base[i]:5.2f}x")
        print(f"{name:20} {alike[name]!s:>10} " + " ".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
