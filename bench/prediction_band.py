"""How close the calibrated stage-time predictions come to the agents' own measurements.

The lab of ``tests/e2e/test_prediction_band.py`` (a coordinator and two paired agents on
127.0.0.1, the tiny decoders under caps that force two stages): one deploy priced by the
roofline alone, then ``--deploys`` deploys each priced with the corrections fitted on the
stages measured before it (:mod:`coordinator.deploy.term_fit`). For every stage it prints the
predicted over measured decode-step time, roofline alone and calibrated, and the median of the
calibrated deploys. Target: the slower stage (the one that sets the plan's throughput) within
0.75-1.33x; the faster stage, a few tenths of a millisecond mostly of fixed costs, is reported
beside it. Both numbers of a ratio come from the same machine in the same minute.

    .venv/bin/python bench/prediction_band.py [--deploys N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from band_lab import CAPS, band_lab, median_ratios, ratios, slowest_stage  # noqa: E402
from report.headlines import Headline, write_headlines  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import track  # noqa: E402
from rich.table import Table  # noqa: E402

from partitioner.models.frontdoor import export_decoder  # noqa: E402

BAND = (0.75, 1.33)
RESULTS = REPO / "bench" / "results" / "prediction_band.md"


@dataclass(frozen=True)
class Calibration:
    """One model's predicted/measured ratios per stage."""

    roofline: list[float]
    """The first deploy's, priced by the roofline alone."""
    calibrated: list[float]
    """The median over the calibrated deploys."""
    slowest: int
    """The stage with the larger measured time (the one that sets the throughput)."""


def _measure(tmp: Path, deploys: int, console: Console) -> dict[str, Calibration]:
    """Per model, its :class:`Calibration` over ``deploys`` calibrated deploys."""
    out: dict[str, Calibration] = {}
    (tmp / "lab").mkdir()
    with band_lab(tmp / "lab") as lab:
        for model in sorted(CAPS):
            export = tmp / model / "export"
            export_decoder(model, export, cache_dir=tmp / model / "cache")
            model_id = f"{model}-band"
            lab.deploy(export, model_id, CAPS[model])
            first = lab.active_segments(model_id)
            calibrated = []
            for _ in track(range(deploys), description=f"{model}: calibrated deploys"):
                lab.deploy(export, model_id, CAPS[model])
                calibrated.append(lab.active_segments(model_id))
            out[model] = Calibration(
                ratios(first), median_ratios(calibrated), slowest_stage(calibrated)
            )
            console.print(f"{model}: runs {[ratios(c) for c in calibrated]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deploys", type=int, default=5, help="calibrated deploys per model")
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="fedshard-band-") as tmp:
        found = _measure(Path(tmp), args.deploys, console)
    table = Table(title="predicted / measured decode-step time per stage")
    for column in ("model", "stage", "roofline alone", "calibrated (median)", "in 0.75-1.33x"):
        table.add_column(column)
    lines = [
        f"# Stage-time calibration ({date.today()}, `bench/prediction_band.py --deploys "
        f"{args.deploys}`)",
        "",
        f"One-minute load average at the end of the run: {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores (ratios are measured side by side, each within a minute).",
        "",
        "| model | stage | roofline alone | calibrated (median) | in 0.75-1.33x |",
        "|---|---|---|---|---|",
    ]
    headlines = []
    for model, calibration in found.items():
        pairs = zip(calibration.roofline, calibration.calibrated, strict=True)
        for stage, (plain, fitted) in enumerate(pairs):
            role = "slower" if stage == calibration.slowest else "faster"
            inside = "yes" if BAND[0] <= fitted <= BAND[1] else "no"
            row = [model, f"{stage} ({role})", f"{plain:.2f}x", f"{fitted:.2f}x", inside]
            table.add_row(*row)
            lines.append("| " + " | ".join(row) + " |")
            target = None if role == "faster" else (">= 0.75" if fitted < 1 else "<= 1.33")
            headlines.append(
                Headline(f"{model} {role} stage predicted / measured", fitted, "x", target)
            )
    console.print(table)
    RESULTS.write_text("\n".join(lines) + "\n")
    write_headlines("prediction_band", headlines)
    console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
