"""What the coordinator shows of the devices' privacy ledgers (issue 39 item 3): each device's
spent and remaining epsilon in the run view, and a lineage that says "non-DP ancestor" instead
of a number where a run of its ancestry trained without DP."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.training.lora.version import _lineage_total, _non_dp_lineage
from coordinator.training.manager import LoraSummary, _Run
from coordinator.training.records import Lineage, TrainingSettings
from protocols.ledger import PrivacyStatus
from protocols.training import RunStatus, TrainingRunRequest

SHA = "0" * 64


def _lineage(epsilon: float | None, **fields: Any) -> Lineage:
    settings = TrainingSettings(
        rounds=2, secagg=True, clipping_norm=1.0, noise_multiplier=1.0, delta=1e-5,
        trainable_shards=[1], local_epochs=2, learning_rate=0.02, batch_size=16, min_clients=3,
    )  # fmt: skip
    return Lineage(
        parent_version="v1", parent_model_sha256=SHA, trained_segments=[1], rounds=2,
        clients_per_round=[3, 3], epsilon=epsilon, delta=1e-5, settings=settings, metrics=[],
        **fields,
    )  # fmt: skip


def test_a_non_dp_ancestor_replaces_the_number(tmp_path: Path) -> None:
    parent: Any = SimpleNamespace(path=tmp_path)
    assert not _non_dp_lineage(parent)  # a version no run wrote
    (tmp_path / "lineage.json").write_text(_lineage(2.0, epsilon_total=2.0).to_json())
    assert not _non_dp_lineage(parent)
    assert _lineage_total(parent, 1.0, None) == 3.0  # no ledgers reported: summed
    assert _lineage_total(parent, 1.0, 7.5) == 7.5  # the devices' ledgers win
    (tmp_path / "lineage.json").write_text(_lineage(None).to_json())
    assert _non_dp_lineage(parent)  # the parent trained without DP
    (tmp_path / "lineage.json").write_text(_lineage(1.0, non_dp_ancestor=True).to_json())
    assert _non_dp_lineage(parent)  # an ancestor did
    (tmp_path / "lineage.json").write_text("{not json")
    assert _non_dp_lineage(parent)  # unreadable: nothing shows the runs were private
    assert _lineage(1.0, non_dp_ancestor=True).epsilon_label == "non-DP ancestor"
    assert _lineage(1.0, epsilon_total=4.25).epsilon_label == "4.25"


def test_the_held_out_means_come_out_of_the_masked_vector() -> None:
    """Devices' ``[loss / 16, has, recall, has]`` arrays, averaged as SecAgg+ does with weight 1
    each: the mean loss and recall@1 over the devices that hold records out."""
    import numpy as np

    from protocols.lora import read_stats, stats_array

    replies = [stats_array(3.0, 0.25), stats_array(5.0, 0.75), stats_array(float("nan"))]
    loss, recall = read_stats(np.mean(replies, axis=0))
    assert loss == pytest.approx(4.0) and recall == pytest.approx(0.5, abs=1e-6)
    decoder = read_stats(np.mean([stats_array(2.0), stats_array(4.0)], axis=0))
    assert decoder[0] == pytest.approx(3.0) and decoder[1] is None
    assert read_stats(np.zeros(4, np.float32)) == (None, None)
    with pytest.raises(ValueError, match="not 4"):
        read_stats(np.zeros(2, np.float32))


def test_the_run_view_shows_each_devices_ledger() -> None:
    run = _Run("r1", threading.Lock(), TrainingRunRequest(rounds=1, model="m"))
    spent = PrivacyStatus(epsilon_spent=3.0, delta_spent=2e-5, budget=8.0, remaining=5.0, rounds=4)
    run.summary(LoraSummary(None, None, [], None, privacy={"phone": spent}))
    shown = RunStatus.from_json(run.status.to_json())
    assert shown.privacy_per_device["phone"].remaining == 5.0
    assert shown.privacy_per_device["phone"].epsilon_spent == 3.0


def test_the_devices_ledgers_hear_what_became_of_each_run() -> None:
    from coordinator.training.errors import DivergedError, TrainingRunError
    from coordinator.training.lora.runner import with_fate
    from protocols.ledger import RunFate

    marks: list[tuple[str, RunFate]] = []

    def mark(run: str, fate: RunFate) -> None:
        marks.append((run, fate))

    def diverge() -> None:
        raise DivergedError("adapters not finite")

    def fail() -> None:
        raise TrainingRunError("round 2 produced no aggregate")

    with_fate("a", mark, lambda: None)
    with pytest.raises(DivergedError):
        with_fate("b", mark, diverge)
    with pytest.raises(TrainingRunError):
        with_fate("c", mark, fail)
    with_fate("d", None, lambda: None)  # local SuperNodes keep no ledger
    assert marks == [("a", RunFate.ROLLED_OUT), ("b", RunFate.DIVERGED), ("c", RunFate.FAILED)]
