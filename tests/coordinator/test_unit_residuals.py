"""Per-unit residuals: what the per-term fit leaves unexplained is kept per planning unit of a
model and prices its later plans (unit tests; the real agents in test_prediction_band.py)."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import onnx
import pytest
from graph_helpers import block_stack
from pydantic import ValidationError

from coordinator.deploy.stage_timing import StageTime, StageTiming, TimingFile
from coordinator.deploy.term_fit import StageTerms
from coordinator.deploy.unit_residuals import (
    HIGHEST,
    LOWEST,
    RESIDUAL_STAGES,
    UnitResiduals,
    unit_scales,
    with_stage,
)
from partitioner.analysis.roofline import scaled_work, stage_seconds
from partitioner.cutting.inputs import SplitOptions
from partitioner.cutting.split import analyse, analysis_work, planning_problem
from protocols.devices import DeviceList
from protocols.problem import Roofs, Work


def test_a_stage_cut_the_same_way_again_is_priced_at_its_geometric_mean() -> None:
    residuals = UnitResiduals()
    assert unit_scales(residuals) is None
    residuals = with_stage(residuals, 4, (0, 1), 0.5)
    residuals = with_stage(residuals, 4, (1, 4), 2.0)
    assert unit_scales(residuals) == pytest.approx([0.5, 2.0, 2.0, 2.0])
    for ratio in (1.0, 4.0):
        residuals = with_stage(residuals, 4, (0, 1), ratio)
    assert unit_scales(residuals)[0] == pytest.approx(2 ** (1 / 3))  # type: ignore[index]
    # out-of-range scales are clamped: one odd measurement cannot make a unit free
    clamped = with_stage(with_stage(UnitResiduals(), 2, (0, 1), 1e-3), 2, (1, 2), 1e3)
    assert unit_scales(clamped) == [LOWEST, HIGHEST]
    # the model cut into another number of units starts again
    assert unit_scales(with_stage(residuals, 3, (2, 3), 3.0)) == pytest.approx([1.0, 1.0, 3.0])


def test_only_the_latest_stages_are_kept() -> None:
    residuals = UnitResiduals()
    for _ in range(RESIDUAL_STAGES):
        residuals = with_stage(residuals, 2, (0, 2), 3.0)
    residuals = with_stage(residuals, 2, (0, 2), 1.0)
    assert len(residuals.stages) == RESIDUAL_STAGES
    assert residuals.stages[-1].ratio == 1.0 and residuals.stages[0].ratio == 3.0


def test_a_second_cut_tells_the_parts_of_a_stage_apart() -> None:
    """Gemma's shape: one stage of units 2-28 measured 1.5x; the next plan cut it at 23, and
    units 23-28 alone measured 1.05x: the rest of the old stage was the slow part."""
    count = 31
    residuals = with_stage(UnitResiduals(), count, (2, 29), 1.5)
    first = unit_scales(residuals)
    assert first is not None
    assert first[2:29] == pytest.approx([1.5] * 27) and first[0] == first[29] == 1.0
    residuals = with_stage(residuals, count, (23, 29), 1.05)
    scales = unit_scales(residuals)
    assert scales is not None
    assert scales[23:29] == pytest.approx([1.05] * 6)
    rest = math.exp((27 * math.log(1.5) - 6 * math.log(1.05)) / 21)
    assert scales[2:23] == pytest.approx([rest] * 21)  # both stages as measured, in logs
    assert math.fsum(math.log(s) for s in scales[2:29]) / 27 == pytest.approx(math.log(1.5))


@pytest.mark.parametrize("seed", range(20))
def test_scales_reproduce_every_stage_of_consistent_cuts(seed: int) -> None:
    """Against the truth: units with random scales, measured by random cuts of whole plans;
    every stage's mean log scale is what it measured (the system is consistent), and a unit
    some stage held alone gets its own scale."""
    rng = random.Random(seed)
    count = rng.randint(2, 9)
    truth = [math.exp(rng.uniform(-1.0, 1.0)) for _ in range(count)]
    residuals = UnitResiduals()
    for _ in range(rng.randint(1, 3)):
        cuts = sorted(rng.sample(range(1, count), rng.randint(0, min(3, count - 1))))
        for lo, hi in itertools.pairwise([0, *cuts, count]):
            mean = math.fsum(math.log(t) for t in truth[lo:hi]) / (hi - lo)
            residuals = with_stage(residuals, count, (lo, hi), math.exp(mean))
    scales = unit_scales(residuals)
    assert scales is not None
    for stage in residuals.stages:
        lo, hi = stage.units
        got = math.fsum(math.log(s) for s in scales[lo:hi]) / (hi - lo)
        assert got == pytest.approx(math.log(stage.ratio), abs=1e-9)
        if hi - lo == 1:
            assert scales[lo] == pytest.approx(truth[lo])


def test_residuals_written_per_unit_are_read_with_the_scales_they_gave() -> None:
    old = UnitResiduals.model_validate({"ratios": [[2.0], [], [0.5, 2.0]]})
    assert old.unit_count == 3
    assert unit_scales(old) == pytest.approx([2.0, 1.0, 1.0])
    # MiniLM's shape: 14 units, three deploys of an embedding stage and three layer stages,
    # more per-unit residuals than stages are kept; the embedding's unit keeps its own
    embedding, layers = [0.5, 0.45, 0.55], [[1.1, 0.9, 1.0], [1.2, 1.3, 1.25], [0.8, 0.85, 0.9]]
    per_unit = [embedding] + [layers[0]] * 5 + [layers[1]] * 4 + [layers[2]] * 4
    before = [math.exp(math.fsum(math.log(r) for r in kept) / 3) for kept in per_unit]
    minilm = UnitResiduals.model_validate({"ratios": per_unit})
    assert len(minilm.stages) == 4
    assert unit_scales(minilm) == pytest.approx(before)
    with pytest.raises(ValidationError, match="per-unit residuals"):
        UnitResiduals.model_validate({"ratios": [[2.0], [-1.0]]})
    with pytest.raises(ValidationError, match="units 2-5 of a model of 3"):
        UnitResiduals.model_validate({"unit_count": 3, "stages": [{"units": [2, 5], "ratio": 1}]})


def _stage(units: tuple[int, int], terms: StageTerms, measured_s: float, version: int) -> StageTime:
    return StageTime("a", terms.total_s, measured_s, terms, version, "minilm", units, 4)


def test_a_small_stage_the_fit_leaves_out_is_priced_at_what_it_measured(tmp_path: Path) -> None:
    """MiniLM's shape: a 0.2 ms embedding stage of element-wise work among 25 ms stages of
    products; the time-weighted fit follows the long stages, the residual fixes the short."""
    embedding = StageTerms(compute_s=0.31e-3, memory_s=0.14e-3, fixed_s=0.02e-3)
    layers = StageTerms(compute_s=30.4e-3, memory_s=0.0, fixed_s=0.05e-3)
    stages = [
        _stage((0, 1), embedding, 0.18e-3, 1),
        _stage((1, 2), layers, 25e-3, 1),
        _stage((2, 3), layers, 26e-3, 1),
        _stage((3, 4), layers, 24e-3, 1),
    ]
    timing = StageTiming(tmp_path)
    assert timing.unit_scales("minilm") is None
    timing.record(stages, {})
    factors = timing.term_factors("minilm")
    assert factors is not None
    predicted = [
        math.fsum(p * f for p, f in zip(s.terms.parts(), vars(factors).values(), strict=True))  # type: ignore[union-attr]
        for s in stages
    ]
    assert predicted[0] / 0.18e-3 > 1.5  # what the fit alone predicts for the embedding
    scales = StageTiming(tmp_path).unit_scales("minilm")  # persisted
    assert scales is not None and len(scales) == 4
    for stage, before, scale in zip(stages, predicted, scales, strict=True):
        assert before * scale == pytest.approx(stage.measured_s, rel=1e-6)
    saved = TimingFile.from_json((tmp_path / "stage-timing.json").read_bytes())
    assert set(saved.residuals) == {"minilm"}
    assert timing.unit_scales("another model") is None


def test_scaled_work_is_priced_that_many_times() -> None:
    work = Work(flops=10**8, bytes_read=10**7, ops=40, vector_flops=10**6)
    roofs = Roofs(gflops=100.0, memory_gbps=10.0, op_us=1.0, vector_gflops=1.0)
    once = stage_seconds([work], roofs) - roofs.call_us / 1e6
    twice = stage_seconds([scaled_work(work, 2.0)], roofs) - roofs.call_us / 1e6
    assert twice == pytest.approx(2 * once, rel=1e-6)


def test_the_planning_problem_prices_units_by_their_scales(tmp_path: Path) -> None:
    model = block_stack(4)
    analysis = analyse(model)
    work = analysis_work(analysis)
    devices = DeviceList.from_obj(
        {
            "devices": [
                {
                    "name": "d",
                    "memory_bytes": 1 << 30,
                    "gflops": 10,
                    "memory_gbps": 10,
                    "bandwidth_mbps": 1,
                }
            ]
        }
    )
    scales = [1.0 + u for u in range(len(work))]
    scaled = planning_problem(analysis, devices, SplitOptions(work_scales=scales), "m")
    assert [u.work for u in scaled.units] == [
        scaled_work(w, s) for w, s in zip(work, scales, strict=True)
    ]
    # scales of another cut of the model are ignored
    other = planning_problem(analysis, devices, SplitOptions(work_scales=[2.0]), "m")
    assert [u.work for u in other.units] == work
    onnx.checker.check_model(model)
