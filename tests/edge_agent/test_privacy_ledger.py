"""The device's privacy ledger and policy without a model (issue 39 item 3): composition, the
typed declines, a ledger that cannot be read, the node config that carries the policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edge_agent.training.client_app import policy_from_node_config, private_reply
from edge_agent.training.errors import LedgerError, RoundDeclinedError
from edge_agent.training.ledger import (
    PrivacyLedger,
    PrivacyPolicy,
    ceil_significant,
    check_round,
    compose,
    planned_mechanism,
    record_round,
)
from edge_agent.training.supernode import SuperNodeConfig, _privacy_node_config
from protocols.ledger import DeclineReason, LedgerDp, RunFate
from protocols.lora import METRIC_EPSILON, METRIC_HELD_OUT_LOSS
from protocols.training import METRIC_EXAMPLES, METRIC_UPLOAD_BYTES

DIGEST = "ab" * 32
ROUND = LedgerDp(noise_multiplier=1.0, sample_rate=0.1, steps=30, delta=1e-5)


def test_composition_is_rdp_like_opacus_and_beats_summing() -> None:
    from opacus.accountants import RDPAccountant

    one, delta = compose([ROUND])
    opacus = RDPAccountant()
    opacus.history = [(1.0, 0.1, 30)]
    assert one == pytest.approx(opacus.get_epsilon(1e-5), rel=2e-3)
    assert delta == pytest.approx(1e-5)
    three, delta3 = compose([ROUND] * 3)
    assert one < three < 3 * one and delta3 == pytest.approx(3e-5)
    assert compose([]) == (0.0, 0.0)


def test_planned_mechanism_is_what_opacus_runs() -> None:
    m = planned_mechanism(1.2, 1e-5, records=100, batch_size=16, epochs=2)
    assert m.sample_rate == pytest.approx(1 / 7) and m.steps == 14


def test_epsilon_is_rounded_up() -> None:
    assert ceil_significant(3.141) == pytest.approx(3.2)
    assert ceil_significant(0.01234) == pytest.approx(0.013)
    assert ceil_significant(12.0) == pytest.approx(12.0)
    reply = private_reply({METRIC_EPSILON: 2.001, METRIC_EXAMPLES: 40, METRIC_UPLOAD_BYTES: 9.0})
    assert reply == {METRIC_EPSILON: pytest.approx(2.1), METRIC_UPLOAD_BYTES: 9.0}
    assert METRIC_HELD_OUT_LOSS not in private_reply({METRIC_HELD_OUT_LOSS: 1.0})


def test_every_round_counts_whatever_became_of_its_run(tmp_path: Path) -> None:
    policy = PrivacyPolicy(tmp_path / "ledger.jsonl", budget=100.0)
    for run in ("a", "b", "c"):
        record_round(policy, DIGEST, run, 1, ROUND, secagg=True)
    ledger = PrivacyLedger(policy.ledger_file)
    ledger.mark("a", RunFate.FAILED)
    ledger.mark("b", RunFate.ROLLED_BACK)
    ledger.mark("c", RunFate.ROLLED_OUT)
    status = ledger.status(policy)
    assert status.epsilon_spent == pytest.approx(compose([ROUND] * 3)[0])
    assert status.rounds == 3 and status.failed_runs == 2
    assert status.remaining == pytest.approx(100.0 - status.epsilon_spent)
    assert policy.ledger_file.read_text().count("\n") == 6  # appended, never rewritten


def test_declines_carry_a_typed_reason(tmp_path: Path) -> None:
    policy = PrivacyPolicy(tmp_path / "ledger.jsonl", budget=compose([ROUND] * 2)[0] * 1.01)
    with pytest.raises(RoundDeclinedError) as no_dp:
        check_round(policy, None, secagg=True)
    assert no_dp.value.reason is DeclineReason.DP_REQUIRED
    assert str(no_dp.value).startswith("dp-required:")
    with pytest.raises(RoundDeclinedError) as no_secagg:
        check_round(policy, ROUND, secagg=False)
    assert no_secagg.value.reason is DeclineReason.SECAGG_REQUIRED
    check_round(policy, ROUND, secagg=True)
    record_round(policy, DIGEST, "r", 1, ROUND, secagg=True)
    check_round(policy, ROUND, secagg=True)  # the second round still fits
    record_round(policy, DIGEST, "r", 2, ROUND, secagg=True)
    with pytest.raises(RoundDeclinedError) as over:
        check_round(policy, ROUND, secagg=True)
    assert over.value.reason is DeclineReason.BUDGET_EXCEEDED
    allowed = PrivacyPolicy(policy.ledger_file, allow_non_dp=True, allow_non_secagg=True)
    check_round(allowed, None, secagg=False)


def test_an_unreadable_ledger_declines_every_round(tmp_path: Path) -> None:
    policy = PrivacyPolicy(tmp_path / "ledger.jsonl", budget=10.0)
    record_round(policy, DIGEST, "r", 1, ROUND, secagg=True)
    with policy.ledger_file.open("a") as f:
        f.write('{"kind": "round", "run": "torn')  # a torn last line
    with pytest.raises(LedgerError, match=":2:"):
        check_round(policy, ROUND, secagg=True)


def test_the_policy_travels_in_the_node_config(tmp_path: Path) -> None:
    from flwr.common.config import parse_config_args

    config = SuperNodeConfig(
        superlink="127.0.0.1:1", root_certificates=tmp_path / "ca.pem",
        segments_dir=tmp_path, data_dir=tmp_path, work_dir=tmp_path,
        ledger_file=tmp_path / "ledger.jsonl", privacy_budget=4.5, allow_non_secagg=True,
    )  # fmt: skip
    parsed = parse_config_args([" ".join(_privacy_node_config(config))])
    policy = policy_from_node_config(dict(parsed))
    assert policy == PrivacyPolicy(
        tmp_path / "ledger.jsonl", budget=4.5, allow_non_dp=False, allow_non_secagg=True
    )
    assert policy_from_node_config({}) is None


def test_the_agent_reports_its_ledger_and_records_what_became_of_a_run(tmp_path: Path) -> None:
    import asyncio

    from edge_agent.net.control import COORDINATOR_ONLY
    from edge_agent.training.copies import TrainingCopies, training_routes
    from protocols.ledger import PRIVACY_PATH, PrivacyStatus, RunFateReport

    policy = PrivacyPolicy(tmp_path / "ledger.jsonl", budget=20.0)
    record_round(policy, DIGEST, "run-1", 1, ROUND, secagg=True)
    routes = training_routes(TrainingCopies(tmp_path, 1 << 20, lambda: None), policy)
    get, post = routes[("GET", PRIVACY_PATH)], routes[("POST", PRIVACY_PATH)]
    assert get.roles == COORDINATOR_ONLY and post.roles == COORDINATOR_ONLY

    async def call(handler: Any, body: bytes) -> Any:
        return await handler(body)

    before = PrivacyStatus.from_json(asyncio.run(call(get.handler, b"")).body)
    assert before.rounds == 1 and before.failed_runs == 0
    assert before.remaining == pytest.approx(20.0 - before.epsilon_spent)
    report = RunFateReport(run="run-1", fate=RunFate.DIVERGED).model_dump_json().encode()
    after = PrivacyStatus.from_json(asyncio.run(call(post.handler, report)).body)
    assert after.failed_runs == 1 and after.epsilon_spent == before.epsilon_spent
    assert ("GET", PRIVACY_PATH) not in training_routes(TrainingCopies(tmp_path, 1, lambda: None))


def test_fedshard_agent_takes_a_privacy_budget_and_allowances(tmp_path: Path) -> None:
    import argparse

    from edge_agent.cli import config_from_args, register
    from edge_agent.errors import ConfigError

    def parse(extra: list[str]) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        base = ["agent", "--name", "a", "--memory", "64MiB", "--state-dir", str(tmp_path / "s")]
        return parser.parse_args(base + extra)

    data = tmp_path / "data"
    data.mkdir()
    (data / "r.txt").write_text("one record\nanother record\n")
    train = ["--train-data", str(data), "--train-superlink", "127.0.0.1:9093"]
    strict = config_from_args(parse(train)).training
    assert strict is not None and strict.privacy_budget is None
    assert not strict.allow_non_dp and not strict.allow_non_secagg  # off by default
    loose = config_from_args(
        parse([*train, "--privacy-budget", "6.5", "--allow-non-dp", "--allow-non-secagg"])
    ).training
    assert loose is not None and loose.privacy_budget == 6.5
    assert loose.allow_non_dp and loose.allow_non_secagg
    with pytest.raises(ConfigError, match="positive"):
        config_from_args(parse([*train, "--privacy-budget", "0"]))
    with pytest.raises(ConfigError, match="need --train-data"):
        config_from_args(parse(["--privacy-budget", "3"]))


def test_a_run_from_an_earlier_runs_version_marks_that_run_branched(tmp_path: Path) -> None:
    from edge_agent.training.ledger import version_digest
    from protocols.ledger import LedgerStatus

    policy = PrivacyPolicy(tmp_path / "ledger.jsonl")
    v1, v2 = version_digest(["a" * 64, "b" * 64]), version_digest(["a" * 64, "c" * 64])
    record_round(policy, DIGEST, "first", 1, ROUND, True, v1)
    record_round(policy, DIGEST, "first", 2, ROUND, True, v1)  # its own rounds: no fate
    record_round(policy, DIGEST, "second", 1, ROUND, True, v2)  # trains first's result
    ledger = PrivacyLedger(policy.ledger_file)
    assert not [line for line in ledger.lines() if isinstance(line, LedgerStatus)]
    record_round(policy, DIGEST, "third", 1, ROUND, True, v1)  # from v1 again: first branched
    fates = [(s.run, s.fate) for s in ledger.lines() if isinstance(s, LedgerStatus)]
    assert fates == [("first", RunFate.BRANCHED)]
    record_round(policy, DIGEST, "third", 2, ROUND, True, v1)  # marked once
    assert len([s for s in ledger.lines() if isinstance(s, LedgerStatus)]) == 1
    status = ledger.status(policy)
    assert status.rounds == 5 and status.failed_runs == 1
    assert status.epsilon_spent == pytest.approx(compose([ROUND] * 5)[0])  # all still count
