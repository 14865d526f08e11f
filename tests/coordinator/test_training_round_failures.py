"""A round in which too few clients succeed fails the run with the reason (nothing is averaged)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.server.strategy import FedAvg

from coordinator.training.errors import TrainingRunError
from coordinator.training.shardavg import ShardLayout
from coordinator.training.strategy import ShardwiseStrategy


def _strategy(min_clients: int) -> ShardwiseStrategy:
    return ShardwiseStrategy(
        FedAvg(),
        ShardLayout((0,)),
        lambda arrays: (float(np.sum(arrays[0])), 0.0),
        min_clients=min_clients,
    )


def test_a_round_without_a_successful_client_fails_with_the_reason() -> None:
    strategy = _strategy(1)
    failure = RuntimeError("TrainDataError: /data: no records in *.jsonl or *.txt files")
    with pytest.raises(TrainingRunError, match=r"0 client.*no records"):
        strategy.aggregate_fit(1, [], [failure])


def test_too_few_results_fail_even_without_reported_failures() -> None:
    with pytest.raises(TrainingRunError, match="failures: none"):
        _strategy(2).aggregate_fit(3, [], [])
