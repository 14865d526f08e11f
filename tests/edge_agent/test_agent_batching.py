"""Batching queued requests of a stateless stage: which segments qualify, stacking, splitting."""

from __future__ import annotations

import numpy as np

from edge_agent.runtime.batching import batch_axis_symbol, signature, split, stack
from edge_agent.runtime.checks import InputSpec


def test_only_a_shared_free_first_axis_makes_a_segment_batchable() -> None:
    inputs = [InputSpec("x", "float32", ("batch", "seq", 8)), InputSpec("m", "int64", ("batch",))]
    assert batch_axis_symbol(inputs, [["batch", 4]]) == "batch"
    assert batch_axis_symbol(inputs, [[1, 4]]) is None  # an output without the axis
    fixed = [InputSpec("x", "float32", (1, "seq", 8))]
    assert batch_axis_symbol(fixed, [[1, 4]]) is None
    mixed = [InputSpec("x", "float32", ("b", 8)), InputSpec("y", "float32", ("n", 8))]
    assert batch_axis_symbol(mixed, [["b", 8]]) is None


def test_stack_and_split_round_trip_and_signatures_ignore_the_batch_axis() -> None:
    rng = np.random.default_rng(0)
    requests = [
        {"x": rng.standard_normal((n, 3, 4)).astype(np.float32), "ids": np.arange(n)}
        for n in (1, 2, 1)
    ]
    assert len({signature(r) for r in requests}) == 1
    feeds, sizes = stack(requests)
    assert sizes == [1, 2, 1] and feeds["x"].shape == (4, 3, 4)
    parts = split({"y": feeds["x"] * 2, "ids": feeds["ids"]}, sizes)
    for request, part in zip(requests, parts, strict=True):
        np.testing.assert_array_equal(part["y"], request["x"] * 2)
        np.testing.assert_array_equal(part["ids"], request["ids"])
    other = {"x": np.zeros((1, 5, 4), np.float32), "ids": np.arange(1)}
    assert signature(other) != signature(requests[0])
