"""A text encoder is planned at the serving shapes with the best plan, not merely the largest.

The deploy ladder (:func:`coordinator.deploy.limits.planning_ladder`) lists the micro-batch
shapes a text encoder can be planned at, largest first. Taken largest-first, a rung whose
activations fit only on a device behind a slow link won over a smaller rung that two fast
devices hold (the LAN lab's MiniLM: 2 x 256 tokens onto a 10 Mbit/s device, 0.92x one device
alone). The pure ordering is checked against brute force over every small case; a real deploy
split of MiniLM shows the choice on devices built to make the largest rung the worse one.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from coordinator.deploy.cutting import DeployCommand, split_and_run
from coordinator.deploy.limits import (
    BATCH,
    RUNG_TOLERANCE,
    SEQUENCE,
    keeping_sequence,
    planning_ladder,
    rungs_by_quality,
)
from protocols.devices import DeviceList

MB = 1_000_000


def _ladder(longest: int, tokens: int) -> list[dict[str, int]]:
    out = []
    budget = tokens
    while budget >= 32:
        sequence = min(longest, budget)
        out.append({BATCH: max(1, budget // sequence), SEQUENCE: sequence})
        budget //= 2
    return out


@pytest.mark.parametrize(("longest", "tokens"), [(256, 512), (128, 512), (512, 512), (64, 256)])
def test_rungs_are_ordered_by_plan_time_per_token(longest: int, tokens: int) -> None:
    ladder = _ladder(longest, tokens)
    keeping = keeping_sequence(ladder)
    assert keeping and all(d[SEQUENCE] == ladder[0][SEQUENCE] for d in keeping)
    shorter = [d for d in ladder if d[SEQUENCE] != ladder[0][SEQUENCE]]
    choices: list[tuple[float, float] | None] = [None]
    choices += list(itertools.product([0.001, 0.002, 0.0041], [0.003, 0.006]))
    for times in itertools.product(choices, repeat=len(keeping)):
        order = rungs_by_quality(ladder, times)
        per_token = {
            i: (t[0] / (d[BATCH] * d[SEQUENCE]), t[1] / (d[BATCH] * d[SEQUENCE]))
            for i, (t, d) in enumerate(zip(times, keeping, strict=True))
            if t is not None
        }
        assert order[len(per_token) :] == shorter
        if not per_token:
            continue

        # brute force: the rung planned first is the largest of those whose objective per token
        # no rung beats by more than the tolerance and whose other measure no such rung beats
        # by more than the tolerance; the other feasible ones follow, largest first
        def within(a: float, values: list[float]) -> bool:
            return all(a <= (1 + RUNG_TOLERANCE) * v for v in values)

        close = [
            i for i, t in per_token.items() if within(t[0], [u[0] for u in per_token.values()])
        ]
        good = [i for i in close if within(per_token[i][1], [per_token[j][1] for j in close])]
        assert order[0] == keeping[min(good)]
        assert order[1 : len(per_token)] == [
            keeping[i] for i in sorted(per_token) if i != min(good)
        ]


def test_rungs_need_one_plan_time_each() -> None:
    ladder = _ladder(256, 512)
    with pytest.raises(ValueError, match="plan times"):
        rungs_by_quality(ladder, [(0.001, 0.002)])


def _devices(fast_cap: int) -> DeviceList:
    """Two fast devices of ``fast_cap`` bytes each and a large one behind a 10 Mbit/s link."""
    names = ("fast-a", "fast-b", "slow-big")
    devices = [
        {"name": "fast-a", "memory_bytes": fast_cap, "gflops": 80, "bandwidth_mbps": 1e4},
        {"name": "fast-b", "memory_bytes": fast_cap, "gflops": 80, "bandwidth_mbps": 1e4},
        {"name": "slow-big", "memory_bytes": 2_000 * MB, "gflops": 80, "bandwidth_mbps": 10},
    ]
    links = [
        {"a": a, "b": b, "bandwidth_mbps": 10.0 if "slow-big" in (a, b) else 1e4}
        for a, b in itertools.combinations(names, 2)
    ]
    requester = {
        "links": [{"device": n, "bandwidth_mbps": 10.0 if n == "slow-big" else 1e4} for n in names]
    }
    return DeviceList.from_obj({"devices": devices, "links": links, "requester": requester})


def _fits_on_the_fast_pair(model: Any, dims: dict[str, int], cap: int) -> bool:
    from partitioner.cutting.inputs import SplitOptions
    from partitioner.cutting.split import analyse, planning_problem
    from partitioner.errors import InfeasiblePlanError
    from partitioner.planning.planner import plan

    devices = _devices(cap).devices[:2]
    options = SplitOptions(dims=dims)
    analysis = analyse(model, dims=dims)
    problem = planning_problem(analysis, DeviceList(devices=devices), options, "minilm")
    try:
        plan(problem, options.objective)
    except InfeasiblePlanError:
        return False
    return True


def _smallest_cap(model: Any, dims: dict[str, int]) -> int:
    low, high = 1 * MB, 400 * MB
    while high - low > MB:
        middle = (low + high) // 2
        low, high = (low, middle) if _fits_on_the_fast_pair(model, dims, middle) else (middle, high)
    return high


@pytest.mark.slow
def test_a_deploy_plans_the_rung_the_fast_devices_hold(minilm_onnx: Path, tmp_path: Path) -> None:
    from coordinator.serving.embeddings import default_tokenizer_dir
    from partitioner.analysis.modelio import load_model

    tokenizer = default_tokenizer_dir("all-minilm-l6-v2")
    if tokenizer is None:
        pytest.skip("the MiniLM tokenizer package is not installed")
    largest, half = keeping_sequence(planning_ladder(tokenizer))[:2]
    model = load_model(minilm_onnx)
    cap = _smallest_cap(model, half)
    assert cap < _smallest_cap(model, largest)  # the largest rung's activations need more
    command = DeployCommand(minilm_onnx, "minilm", tokenizer_dir=tokenizer)
    outcome = split_and_run(command, _devices(cap), tmp_path / "cut")
    # planned largest-first, the chain would reach the slow device; by quality it stays on
    # the fast pair at half the tokens per run, and the limits say so
    assert {s.device for s in outcome.manifest.segments} <= {"fast-a", "fast-b"}
    assert outcome.limits is not None
    assert outcome.limits.product == half[BATCH] * half[SEQUENCE]
    assert outcome.limits.dims[SEQUENCE] == largest[SEQUENCE]  # every input still whole
