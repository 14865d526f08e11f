"""Frame codec throughput against a plain numpy copy of the same bytes, side by side in one run.

Targets (issue 2): decoding at least as fast as the copy (it should not copy at all);
encoding to one ``bytes`` object at least half as fast as the copy.

    .venv/bin/python bench/frames.py [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from report.headlines import Headline, write_headlines
from rich.console import Console
from rich.table import Table

from protocols.frames import FrameHeader, decode_frame, encode_frame

SIZES = {"64 KiB": 64 << 10, "1 MiB": 1 << 20, "16 MiB": 16 << 20}
RESULTS = Path(__file__).parent / "results" / "frames.md"


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Best of ``repeat`` timings of ``fn`` (the least disturbed by a noisy machine)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(nbytes: int, repeat: int) -> dict[str, float]:
    """GB/s of a numpy copy, frame encode and frame decode of one float32 tensor of ``nbytes``."""
    tensor = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    header = FrameHeader(request_id="bench", segment_index=1, plan_version=1)
    frame = encode_frame(header, {"hidden": tensor})
    copy_s = best_seconds(lambda: tensor.copy(), repeat)
    encode_s = best_seconds(lambda: encode_frame(header, {"hidden": tensor}), repeat)
    decode_s = best_seconds(lambda: decode_frame(frame).tensors["hidden"], repeat)
    assert np.array_equal(decode_frame(frame).tensors["hidden"], tensor)
    return {
        name: nbytes / s / 1e9
        for name, s in (("copy", copy_s), ("encode", encode_s), ("decode", decode_s))
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    table = Table(title=f"frame codec vs numpy copy ({os.cpu_count()} cores)")
    for column in (
        "tensor",
        "copy GB/s",
        "encode GB/s",
        "decode GB/s",
        "encode/copy",
        "decode/copy",
        "targets",
    ):
        table.add_column(column, justify="right")
    rows = []
    headlines = []
    for label, nbytes in SIZES.items():
        r = measure(nbytes, args.repeat)
        enc, dec = r["encode"] / r["copy"], r["decode"] / r["copy"]
        if nbytes >= 1 << 20:
            headlines += [
                Headline(f"frame decode speed / numpy copy, {label}", dec, "x", ">= 1"),
                Headline(f"frame encode speed / numpy copy, {label}", enc, "x", ">= 0.5"),
            ]
        ok = "met" if enc >= 0.5 and dec >= 1.0 else "MISSED"
        rows.append(
            (
                label,
                f"{r['copy']:.2f}",
                f"{r['encode']:.2f}",
                f"{r['decode']:.2f}",
                f"{enc:.2f}×",
                f"{dec:.1f}×",
                ok,
            )
        )
        table.add_row(*rows[-1])
    Console().print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "| tensor | copy GB/s | encode GB/s | decode GB/s | encode/copy | decode/copy | targets |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    RESULTS.write_text("# Frame codec\n\n" + "\n".join(lines) + "\n")
    write_headlines("frames", headlines)


if __name__ == "__main__":
    main()
