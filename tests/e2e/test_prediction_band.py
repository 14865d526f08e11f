"""Integration: the plan's stage times are calibrated on real agents.

A coordinator and two paired agents on 127.0.0.1 (each measuring its roofs the way ``fedshard
profile`` does: compute, memory and cache bandwidth, the cost of an operator, of a segment run
and of a ``TopK`` element) serve the tiny decoders under caps that force two stages
(``tiny-llama``: the embedding and the output head, 7.8 MB each, plus the KV cache fit on no one
device at 14 MB; ``tiny-gemma3`` likewise at 16 MB). The first deploy is priced by the roofline
alone; each agent measures its operator, call and ``TopK`` costs again around its warm-up and
reports them with its stage time, and the coordinator fits one correction per part of the
prediction (compute, memory, fixed costs: :mod:`coordinator.deploy.term_fit`) on the measured
stages. The deploys after it are priced with the latest costs and those corrections.

What this test holds is the mechanism: every agent's costs and stage times reach the
coordinator, the stages are kept for the fit, and the calibrated deploys are priced with the
corrections (their predictions move away from the roofline's). How close the calibrated
predictions come to the measured stage times is a speed figure, measured side by side by
``bench/prediction_band.py`` (target: the slower stage within 0.75-1.33x); on CI's shared two-core
machine one deploy's minute can run 1.6x faster or slower than the next, so the test asserts only
a gross band (:data:`GROSS_BAND`) that a wrong unit or a dropped term would leave.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from band_lab import CAPS, BandLab, band_lab, median_ratios, ratios

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GROSS_BAND = (0.25, 4.0)
"""Calibrated predicted/measured stage time, median over the deploys: outside it the cost model
is wrong by a factor no machine load explains (a unit, a missing term). The tight band is
``bench/prediction_band.py``'s."""
CALIBRATED_DEPLOYS = 3


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BandLab]:
    with band_lab(tmp_path_factory.mktemp("prediction-band")) as started:
        yield started


@pytest.mark.parametrize("model", sorted(CAPS))
def test_measured_stage_costs_calibrate_the_next_plan(
    lab: BandLab, model: str, request: pytest.FixtureRequest
) -> None:
    export: Path = request.getfixturevalue(f"{model.replace('-', '_')}_dir")  # exported if run
    model_id = f"{model}-band"
    lab.deploy(export, model_id, CAPS[model])
    first = lab.active_segments(model_id)
    timing = json.loads((lab.coordinator.state_dir / "stage-timing.json").read_text())
    assert {a.name for a in lab.agents} <= set(timing["devices"])
    # each agent measured its operator, call and TopK costs with its warm-up, and the stages
    # were kept for the per-term fit
    assert all(isinstance(s["costs"], dict) and s["costs"]["op_us"] > 0 for s in first)
    assert len(timing["stages"]) >= 2
    calibrated = []
    for _ in range(CALIBRATED_DEPLOYS):
        lab.deploy(export, model_id, CAPS[model])
        calibrated.append(lab.active_segments(model_id))
    medians = median_ratios(calibrated)
    print(
        f"{model} predicted/measured per stage: roofline alone {ratios(first)}, calibrated "
        f"{[ratios(c) for c in calibrated]} (median {medians}); prefill predicted "
        f"{[s['predicted_prefill_s'] for s in calibrated[-1]]} s"
    )
    assert all(len(segments) == 2 for segments in calibrated)
    assert all(r > 0 for segments in calibrated for r in ratios(segments))
    assert all(isinstance(s["predicted_prefill_s"], float) for s in calibrated[-1])
    roofline = [float(str(s["predicted_compute_s"])) for s in first]
    priced = [float(str(s["predicted_compute_s"])) for s in calibrated[-1]]
    assert priced != roofline, "the calibrated deploy was priced as the roofline alone"
    assert all(GROSS_BAND[0] <= r <= GROSS_BAND[1] for r in medians), (
        f"{model}: calibrated predicted/measured median {medians}, outside {GROSS_BAND}"
    )
