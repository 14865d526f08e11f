"""A device's LoRA rounds under DP, through its real client (issue 39 items 1-3).

The tiny Llama, split by the planner; one device with WordNet records. Asserted: two DP rounds
with identical inputs (node id, round, data, global torch seed) give different adapters while
rounds without DP are reproducible; a DP reply carries exactly the fields
:data:`protocols.privacy.FIT_REPLY_FIELDS` lists as sent under DP; the final evaluation under DP
leaves only inside SecAgg+ (the evaluate-only round) and a clear one is refused, as
:data:`~protocols.privacy.EVALUATE_REPLY_FIELDS` says; the device's ledger records
every round and the device declines, with a typed reason, a round past its budget, without DP or
without SecAgg+.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common import EvaluateIns, FitIns, ndarrays_to_parameters, parameters_to_ndarrays

from devtools.lora_lab import LoraSetup, lora_setup, plan_config, split_version
from edge_agent.training.client_app import ShardClient, client_fn
from edge_agent.training.errors import ClearReleaseError, RoundDeclinedError
from edge_agent.training.ledger import PrivacyLedger, PrivacyPolicy, compose
from edge_agent.training.local import LocalSettings
from protocols.ledger import DeclineReason, LedgerRound, RunFate
from protocols.lora import (
    EVALUATE_ONLY_KEY,
    METRIC_EPSILON,
    METRIC_HELD_OUT_LOSS,
    METRIC_PEAK_RSS,
    METRIC_RECALL_AT_1,
    STATS_SCALE,
    STATS_SIZE,
    LoraPlan,
    RecordDp,
    read_stats,
)
from protocols.privacy import (
    EVALUATE_REPLY_FIELDS,
    FIT_REPLY_FIELDS,
    SECAGG_CONFIG_KEY,
    reply_fields,
)
from protocols.training import METRIC_EXAMPLES, METRIC_LOSS

pytestmark = pytest.mark.slow

DP = RecordDp(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)


@pytest.fixture(scope="module")
def lab(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[LoraSetup, Path]:
    from devtools.wordnet import write_shares
    from partitioner.models.decoders import tiny

    root = tmp_path_factory.mktemp("privacy")
    version = split_version(tiny_llama_dir, root / "v0001")
    model, _ = tiny.llama()
    setup = lora_setup(
        tiny_llama_dir, version, model, 2, dp=DP, max_tokens=16, batch_size=8,
        learning_rate=0.02,
    )  # fmt: skip
    (data,) = write_shares(root / "data", [("noun.animal",)], per_device=40)
    return setup, data


def _client(lab: tuple[LoraSetup, Path], cache: Path, policy: PrivacyPolicy | None = None) -> Any:
    setup, data = lab
    return ShardClient(LocalSettings(setup.version_dir, data, cache, 1 << 30, policy), 7)


def _fit(client: Any, plan: LoraPlan, arrays: list[np.ndarray], secagg: bool = True) -> Any:
    config = {**plan_config(plan, 3), SECAGG_CONFIG_KEY: secagg}
    torch.manual_seed(0)  # the same global seed each time: DP must not depend on it
    return client.fit(arrays, config)


def test_dp_rounds_are_not_reproducible_rounds_without_dp_are(
    lab: tuple[LoraSetup, Path], tmp_path: Path
) -> None:
    setup, _ = lab
    first = _fit(_client(lab, tmp_path / "a"), setup.plan, setup.initial)[0]
    second = _fit(_client(lab, tmp_path / "b"), setup.plan, setup.initial)[0]
    assert any(not np.array_equal(x, y) for x, y in zip(first, second, strict=True))
    plain = setup.plan.model_copy(update={"dp": None})
    third = _fit(_client(lab, tmp_path / "c"), plain, setup.initial)[0]
    fourth = _fit(_client(lab, tmp_path / "d"), plain, setup.initial)[0]
    assert all(np.array_equal(x, y) for x, y in zip(third, fourth, strict=True))


def test_a_dp_reply_carries_only_what_the_table_lists(
    lab: tuple[LoraSetup, Path], tmp_path: Path
) -> None:
    setup, _ = lab
    client = _client(lab, tmp_path / "a").to_client()
    config = {**plan_config(setup.plan, 1), SECAGG_CONFIG_KEY: True}
    res = client.fit(FitIns(ndarrays_to_parameters(setup.initial), config))
    sent = reply_fields(dp=True)
    known = {f.name for f in FIT_REPLY_FIELDS}
    assert set(res.metrics) <= known, set(res.metrics) - known  # nothing outside the table
    assert set(res.metrics) == sent - {"parameters", "num_examples"}
    assert res.num_examples == 1  # the weight, not the record count
    # the adapters, then the held-out statistics, both inside the SecAgg+ vector
    assert len(res.parameters.tensors) == setup.plan.num_arrays + 1
    stats = parameters_to_ndarrays(res.parameters)[-1]
    assert stats.shape == (STATS_SIZE,) and stats[1] == 1.0 and 0 < stats[0] * STATS_SCALE < 20
    assert stats[3] == 0.0  # a decoder has no recall@1
    kept = reply_fields(dp=True, sent=False)
    assert {METRIC_EXAMPLES, METRIC_LOSS, METRIC_HELD_OUT_LOSS, METRIC_PEAK_RSS} <= kept
    # without DP the same client sends the records' statistics (the table says so too)
    plain = setup.plan.model_copy(update={"dp": None})
    res = client.fit(FitIns(ndarrays_to_parameters(setup.initial), plan_config(plain, 1)))
    clear = {METRIC_EXAMPLES, METRIC_LOSS, METRIC_HELD_OUT_LOSS}
    assert clear <= set(res.metrics) <= reply_fields(dp=False)


def test_the_final_evaluation_leaves_only_inside_secagg_under_dp(
    lab: tuple[LoraSetup, Path], tmp_path: Path
) -> None:
    """The evaluate-only round's reply: zero adapters and the held-out statistics (masked), and
    only the table's DP fields; a clear evaluation is refused over the wire under DP, and
    without DP it carries exactly the evaluate table's fields."""
    setup, data = lab
    settings = LocalSettings(setup.version_dir, data, tmp_path, 1 << 30)
    context = Context(1, 7, {"segments-dir": str(setup.version_dir), "data-dir": str(data),
                             "cache-dir": str(tmp_path)}, RecordDict(), {})  # fmt: skip
    wire = client_fn(context)  # the client Flower runs
    config = {**plan_config(setup.plan, 3), SECAGG_CONFIG_KEY: True, EVALUATE_ONLY_KEY: True}
    res = wire.fit(FitIns(ndarrays_to_parameters(setup.initial), config))
    arrays = parameters_to_ndarrays(res.parameters)
    assert len(arrays) == setup.plan.num_arrays + 1 and res.num_examples == 1
    assert all(not a.any() for a in arrays[:-1])  # nothing trained, nothing of it sent
    loss, recall = read_stats(arrays[-1])
    assert loss is not None and 0 < loss < 20 and recall is None
    assert set(res.metrics) <= reply_fields(dp=True) - {METRIC_EPSILON}  # no round was spent
    # the same evaluation in clear: refused over the wire, the owner's own call reads it
    ins = EvaluateIns(ndarrays_to_parameters(setup.initial), plan_config(setup.plan, 3))
    with pytest.raises(ClearReleaseError):
        wire.evaluate(ins)
    owner = ShardClient(settings, 7).evaluate(setup.initial, plan_config(setup.plan, 3))
    assert owner[0] == pytest.approx(loss, rel=1e-4)  # the aggregate of one device is its own
    plain = setup.plan.model_copy(update={"dp": None})
    done = wire.evaluate(EvaluateIns(ndarrays_to_parameters(setup.initial), plan_config(plain, 3)))
    sent = {"loss", "num_examples", *done.metrics}  # a decoder has no recall@1
    assert sent == reply_fields(dp=False, table=EVALUATE_REPLY_FIELDS) - {METRIC_RECALL_AT_1}
    assert reply_fields(dp=True, table=EVALUATE_REPLY_FIELDS) == frozenset()


def test_the_ledger_counts_every_round_and_the_budget_declines(
    lab: tuple[LoraSetup, Path], tmp_path: Path
) -> None:
    setup, _ = lab
    policy = PrivacyPolicy(tmp_path / "ledger.jsonl")
    client = _client(lab, tmp_path / "cache", policy)
    _fit(client, setup.plan, setup.initial)
    other_run = setup.plan.model_copy(update={"run": "another-run"})
    _fit(client, other_run, setup.initial)
    ledger = PrivacyLedger(policy.ledger_file)
    rounds = ledger.rounds()
    assert [r.run for r in rounds] == [setup.plan.run, "another-run"]
    assert all(isinstance(r, LedgerRound) and r.dp is not None and r.secagg for r in rounds)
    assert len({r.data_sha256 for r in rounds}) == 1  # keyed by the records, not the run
    ledger.mark("another-run", RunFate.ROLLED_BACK)
    status = ledger.status(policy)
    one = rounds[0].epsilon
    assert one is not None and one < status.epsilon_spent < 2 * one  # RDP beats summing
    assert status.epsilon_spent == pytest.approx(compose([r.dp for r in rounds if r.dp])[0])
    # the first run is branched (the second trained the same version), the second rolled back
    assert status.rounds == 2 and status.failed_runs == 2
    assert status.delta_spent == pytest.approx(2 * DP.delta)

    tight = replace(policy, budget=status.epsilon_spent * 1.05)  # the next round does not fit
    with pytest.raises(RoundDeclinedError) as declined:
        _fit(_client(lab, tmp_path / "cache", tight), setup.plan, setup.initial)
    assert declined.value.reason is DeclineReason.BUDGET_EXCEEDED
    assert len(ledger.rounds()) == 2  # a declined round trains and records nothing
    status = ledger.status(tight)
    assert status.remaining == pytest.approx(tight.budget - status.epsilon_spent)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("dp", "secagg", "reason"),
    [(None, True, DeclineReason.DP_REQUIRED), (DP, False, DeclineReason.SECAGG_REQUIRED)],
)
def test_a_device_declines_rounds_its_operator_did_not_allow(
    lab: tuple[LoraSetup, Path],
    tmp_path: Path,
    dp: RecordDp | None,
    secagg: bool,
    reason: DeclineReason,
) -> None:
    setup, _ = lab
    plan = setup.plan.model_copy(update={"dp": dp})
    policy = PrivacyPolicy(tmp_path / "ledger.jsonl")
    with pytest.raises(RoundDeclinedError) as declined:
        _fit(_client(lab, tmp_path / "c", policy), plan, setup.initial, secagg=secagg)
    assert declined.value.reason is reason
    assert PrivacyLedger(policy.ledger_file).rounds() == []
    allowed = PrivacyPolicy(policy.ledger_file, allow_non_dp=True, allow_non_secagg=True)
    _fit(_client(lab, tmp_path / "c", allowed), plan, setup.initial, secagg=secagg)
    (line,) = PrivacyLedger(policy.ledger_file).rounds()
    assert (line.dp is None) == (dp is None) and line.secagg == secagg
