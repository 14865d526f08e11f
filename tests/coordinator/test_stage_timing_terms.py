"""Per-term calibration: the agents' fixed costs measured with the warm-up, the two-factor fit
and the stage-timing file that keeps the stages (unit tests; the agents and the coordinator
for real are in test_prediction_band.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.deploy.plan import LiveDevice
from coordinator.deploy.stage_timing import (
    MAX_STAGES,
    STAGE_WINDOW,
    StageTime,
    StageTiming,
    TimingFile,
    roofs_of,
)
from coordinator.deploy.term_fit import (
    HIGHEST,
    LOWEST,
    StageTerms,
    TermFactors,
    TermSample,
    fit_terms,
    stage_terms,
)
from edge_agent.config import RuntimeConfig
from edge_agent.profile.membench import CACHE_PROBE_BYTES, cache_points
from edge_agent.runtime.fixed_costs import COSTS_WINDOW, FixedCostProbe, RecentCosts, mean_costs
from partitioner.analysis.roofline import stage_seconds
from protocols.deploy import DeployReport, FixedCosts
from protocols.errors import SchemaError
from protocols.problem import Work


def _live(name: str, memory_gbps: float | None = 10.0) -> LiveDevice:
    return LiveDevice(
        name=name,
        budget_bytes=1 << 30,
        committed_bytes=0,
        gflops=100.0,
        host="127.0.0.1",
        control_port=1,
        data_port=2,
        memory_gbps=memory_gbps,
        cache_bytes=1 << 20,
        cache_gbps=40.0,
        op_us=0.5,
        call_us=5.0,
        topk_ns=1.0,
    )


# ----------------------------------------------------------------------------- the parts


def test_stage_terms_add_up_to_the_stage_time_the_planner_charges() -> None:
    work = [Work(flops=10**6, bytes_read=4 << 20, ops=70), Work(flops=0, bytes_read=900, ops=3)]
    work.append(Work(flops=10**7, bytes_read=100, ops=2, topk_elements=32_000))
    roofs = roofs_of(_live("a"))
    terms = stage_terms(work, roofs, None)
    assert terms.total_s == pytest.approx(stage_seconds(work, roofs))
    # the stage reads 4 MiB in all, beyond the 1 MiB cache: every unit reads at memory speed
    assert terms.memory_s == pytest.approx((4 << 20) / 10e9 + 900 / 10e9)
    assert terms.compute_s == pytest.approx(10**7 / 100e9)
    assert terms.fixed_s == pytest.approx((75 * 0.5 + 5.0) / 1e6 + 32_000 * 1.0 / 1e9)
    # with the costs the agent measured next to its warm-up, only the fixed part moves
    fresh = FixedCosts(op_us=1.0, call_us=10.0, topk_ns=2.0)
    again = stage_terms(work, roofs, fresh)
    assert (again.compute_s, again.memory_s) == (terms.compute_s, terms.memory_s)
    assert again.fixed_s == pytest.approx(2 * terms.fixed_s)


# ----------------------------------------------------------------------------- the fit


def _sample(
    compute: float, memory: float, fixed: float, factors: tuple[float, ...], age: int = 0
) -> TermSample:
    measured = compute * factors[0] + memory * factors[1] + fixed * factors[2]
    return TermSample(StageTerms(compute, memory, fixed), measured, age)


def test_stages_of_different_make_fix_every_factor() -> None:
    truth = (1.6, 1.3, 0.85)
    # tiny-llama here: the first stage almost all fixed cost, the last almost all bytes;
    # a MiniLM stage almost all compute
    first = _sample(0.0, 12e-6, 77e-6, truth)
    last = _sample(0.0, 288e-6, 81e-6, truth)
    encoder = _sample(9e-3, 0.0, 40e-6, truth, age=1)  # deployed before tiny-llama
    factors = fit_terms([first, last, encoder])
    assert (factors.compute, factors.memory, factors.fixed) == pytest.approx(truth, rel=0.02)
    # one scalar could not: each stage alone says 0.91x, 1.20x and 1.59x
    assert first.measured_s / first.terms.total_s < 0.95
    assert last.measured_s / last.terms.total_s > 1.15
    # a part no stage has stays at 1
    assert fit_terms([first, last]).compute == pytest.approx(1.0)


def test_the_fit_is_defined_on_one_stage_clamped_and_newer_deploys_weigh_more() -> None:
    one = fit_terms([TermSample(StageTerms(0.0, 0.0, 1e-4), 2e-4)])
    assert one.fixed == pytest.approx(2.0, rel=0.05)
    assert one.memory == one.compute == pytest.approx(1.0)
    assert fit_terms([]) == TermFactors()
    ten = fit_terms([TermSample(StageTerms(0.0, 1e-4, 0.0), 1e-3)])
    assert ten.memory == pytest.approx(10.0, rel=0.05)  # the pull does not hold it back
    huge = fit_terms([TermSample(StageTerms(0.0, 1e-9, 0.0), 1.0)])
    assert huge.memory == HIGHEST
    assert min(huge.compute, huge.fixed) >= LOWEST
    old = TermSample(StageTerms(0.0, 1e-4, 0.0), 3e-4, age=3)
    new = TermSample(StageTerms(0.0, 1e-4, 0.0), 1e-4, age=0)
    assert fit_terms([old, new]).memory < 1.5  # the old deploy weighs 1/8


def test_a_deploys_short_stages_do_not_outvote_its_long_ones() -> None:
    # MiniLM in the demo: a 0.17 ms embedding stage predicted 1.6x, three 26 ms stages 0.81x
    embedding = TermSample(StageTerms(226e-6, 29e-6, 16e-6), 0.17e-3)
    layers = [TermSample(StageTerms(21.6e-3, 0.0, 43e-6), 26.4e-3) for _ in range(3)]
    factors = fit_terms([embedding, *layers])
    assert factors.compute == pytest.approx(26.4 / 21.6, rel=0.02)
    # what the embedding stage alone would say of memory and fixed costs is not enough to
    # move them far (weighed alike, the fit had pinned both at the floor, 0.05)
    assert factors.memory > 0.7 and factors.fixed > 0.7


# ----------------------------------------------------------------------------- the file


def _two_stages(version: int) -> list[StageTime]:
    return [
        StageTime("a", 89e-6, 93e-6, StageTerms(0.0, 12e-6, 77e-6), version),
        StageTime("b", 369e-6, 448e-6, StageTerms(0.0, 288e-6, 81e-6), version),
    ]


def test_recorded_stages_price_later_plans_per_term_and_persist(tmp_path: Path) -> None:
    timing = StageTiming(tmp_path)
    assert timing.term_factors() is None
    assert timing.apply([_live("a")]) == [_live("a")]
    timing.record(_two_stages(1), {})
    factors = timing.term_factors()
    assert factors is not None
    assert factors.memory == pytest.approx(1.27, abs=0.02)
    assert factors.fixed == pytest.approx(1.01, abs=0.02)
    assert factors.compute == pytest.approx(1.0)
    # a device the stages never ran on is priced with the same factors: they are per term
    [c] = timing.apply([_live("c")])
    assert c.gflops == pytest.approx(100.0 / factors.compute)
    assert (c.memory_gbps, c.cache_gbps) == pytest.approx(
        (10.0 / factors.memory, 40.0 / factors.memory)
    )
    assert (c.op_us, c.call_us) == pytest.approx((0.5 * factors.fixed, 5.0 * factors.fixed))
    # each measured stage is predicted again from its parts: the stage the agent measured
    for stage in _two_stages(1):
        assert stage.terms is not None
        predicted = stage.terms.memory_s * factors.memory + stage.terms.fixed_s * factors.fixed
        assert predicted == pytest.approx(stage.measured_s, rel=0.03)
    # devices priced by FLOPs alone keep their own scalar correction
    [legacy] = timing.apply([_live("a", memory_gbps=None)])
    assert legacy.correction == pytest.approx(timing.factor("a"))
    again = StageTiming(tmp_path)
    assert again.term_factors() == factors
    saved = TimingFile.from_json((tmp_path / "stage-timing.json").read_bytes())
    assert saved.format == "fedshard.stage-timing/2" and len(saved.stages) == 2
    assert TimingFile.from_json(saved.to_json()) == saved
    for version in range(2, 10):
        timing.record(_two_stages(version), {})
    kept = TimingFile.from_json((tmp_path / "stage-timing.json").read_bytes()).stages
    assert len(kept) == STAGE_WINDOW and kept[-1].plan_version == 9


def _memory_stages(model: str, version: int, slowdown: float) -> list[StageTime]:
    """Two memory-bound stages of ``model`` that ran ``slowdown`` times their prediction."""
    terms = [StageTerms(0.0, 1e-3, 1e-5), StageTerms(0.0, 3e-3, 2e-5)]
    return [
        StageTime(d, t.total_s, t.total_s * slowdown, t, version, model)
        for d, t in zip("ab", terms, strict=True)
    ]


def test_each_model_is_priced_by_its_own_stages(tmp_path: Path) -> None:
    timing = StageTiming(tmp_path)
    timing.record(_memory_stages("int4", 1, 0.6), {})
    timing.record(_memory_stages("int8", 2, 2.0), {})
    int4, int8 = timing.term_factors("int4"), timing.term_factors("int8")
    assert int4 is not None and int8 is not None
    assert int4.memory == pytest.approx(0.6, rel=0.05)
    assert int8.memory == pytest.approx(2.0, rel=0.05)
    # a model never deployed is priced by the latest stages of any model: both here
    new = timing.term_factors("new")
    assert new is not None and int4.memory < new.memory < int8.memory
    [a4], [a8] = timing.apply([_live("a")], "int4"), timing.apply([_live("a")], "int8")
    assert a4.memory_gbps == pytest.approx(10.0 / int4.memory)
    assert a8.memory_gbps == pytest.approx(10.0 / int8.memory)
    # one model's many deploys keep the other's stages (each keeps its latest window)
    for version in range(3, 3 + STAGE_WINDOW):
        timing.record(_memory_stages("int4", version, 0.6), {})
    kept = StageTiming(tmp_path)
    assert kept.term_factors("int8") == int8
    stages = TimingFile.from_json((tmp_path / "stage-timing.json").read_bytes()).stages
    assert sum(s.model == "int4" for s in stages) == STAGE_WINDOW
    assert sum(s.model == "int8" for s in stages) == 2
    # and many models keep at most MAX_STAGES in all, the latest
    for version in range(20, 20 + MAX_STAGES):
        timing.record(_memory_stages(f"m{version}", version, 1.0), {})
    stages = TimingFile.from_json((tmp_path / "stage-timing.json").read_bytes()).stages
    assert len(stages) == MAX_STAGES and stages[-1].model == f"m{19 + MAX_STAGES}"


def test_stage_timing_files_from_before_the_fit_are_still_read(tmp_path: Path) -> None:
    old = {"devices": {"a": {"ratios": [2.0, 2.0]}}}
    (tmp_path / "stage-timing.json").write_text(json.dumps(old))
    timing = StageTiming(tmp_path)
    assert timing.factor("a") == pytest.approx(2.0)
    assert timing.term_factors() is None  # no stages yet: the scalar still prices "a"
    [a] = timing.apply([_live("a")])
    assert a.op_us == pytest.approx(1.0)
    with pytest.raises(SchemaError):
        TimingFile.from_json(json.dumps({**old, "format": "fedshard.stage-timing/9"}))


# ----------------------------------------------------------------------------- the agent side


def test_deploy_reports_carry_the_costs_and_old_reports_still_read() -> None:
    fields = {
        "device": "a",
        "plan_version": 3,
        "segment_sha256": "0" * 64,
        "predicted_memory_bytes": 10,
        "measured_memory_bytes": 12,
        "predicted_compute_s": 1e-4,
        "load_s": 0.1,
        "warmup_first_s": 2e-4,
        "warmup_s": 1e-4,
    }
    old = DeployReport.from_json(json.dumps(fields))
    assert old.costs is None
    costs = FixedCosts(op_us=0.4, call_us=4.0, topk_ns=0.8)
    new = old.model_copy(update={"costs": costs})
    assert DeployReport.from_json(new.model_dump_json()) == new
    with pytest.raises(SchemaError):
        DeployReport.from_json(json.dumps({**fields, "costs": {"op_us": 1, "extra": 2}}))
    mean = mean_costs(costs, FixedCosts(op_us=0.6, call_us=6.0, topk_ns=1.2))
    assert mean == FixedCosts(op_us=0.5, call_us=5.0, topk_ns=1.0)


def test_announced_costs_are_the_median_of_the_latest_warm_ups() -> None:
    recent = RecentCosts()
    usual = FixedCosts(op_us=0.5, call_us=5.0, topk_ns=1.0)
    assert recent.add(usual) == usual
    slow = FixedCosts(op_us=1.0, call_us=9.0, topk_ns=2.0)
    assert recent.add(slow) == FixedCosts(op_us=0.75, call_us=7.0, topk_ns=1.5)
    assert recent.add(usual) == usual  # one slow warm-up among usual ones is left out
    for _ in range(COSTS_WINDOW):  # a device that stays slower is followed
        announced = recent.add(slow)
    assert announced == slow
    # each cost is its own median, not one measurement's
    odd = FixedCosts(op_us=0.1, call_us=50.0, topk_ns=1.0)
    recent = RecentCosts()
    for costs in (usual, odd, slow):
        announced = recent.add(costs)
    assert announced == FixedCosts(op_us=0.5, call_us=9.0, topk_ns=1.0)


def test_the_fixed_cost_probe_measures_every_cost_again() -> None:
    probe = FixedCostProbe(RuntimeConfig())
    runs = [probe.measure() for _ in range(3)]
    assert all(r.op_us > 0 and r.call_us > 0 and r.topk_ns > 0 for r in runs)
    # an operator costs less than a whole segment run, a TopK element less than an operator
    assert all(r.op_us < r.call_us and r.topk_ns / 1e3 < r.op_us for r in runs)


def test_cache_probes_cover_every_size_once() -> None:
    points = cache_points(RuntimeConfig(), passes=2)
    assert [size for size, _ in points] == sorted(CACHE_PROBE_BYTES)
    assert all(gbps > 0 for _, gbps in points)


def test_4bit_products_have_a_factor_of_their_own() -> None:
    # MiniLM's layer stages (compute, 1.22x their prediction), then a Qwen int4 stage whose
    # bytes and 4-bit products were predicted right: the encoder's factor must not reach them
    encoder = [TermSample(StageTerms(21.6e-3, 0.0, 43e-6), 26.4e-3, age=1) for _ in range(3)]
    decoder = TermSample(StageTerms(0.0, 13.4e-3, 0.5e-3, gemv_s=9.1e-3), 23.0e-3)
    factors = fit_terms([*encoder, decoder])
    assert factors.compute == pytest.approx(26.4 / 21.6, rel=0.03)
    assert factors.gemv == pytest.approx(1.0, abs=0.1)
    assert factors.memory == pytest.approx(1.0, abs=0.1)
