"""The draft length from measured throughput: pure rule, per-deployment estimates, probes."""

from __future__ import annotations

import contextlib

import pytest

from coordinator.generation.tuning import (
    Costs,
    DraftLength,
    Throughput,
    acceptance_rate,
    best_length,
    expected_tokens,
    pass_acceptance,
    tokens_per_s,
)


def test_the_reported_rate_counts_every_draft_and_the_tuned_one_stops_at_a_rejection() -> None:
    assert acceptance_rate(0, 0) is None
    assert acceptance_rate(4, 1) == 0.25  # the console's and the benchmarks' figure
    assert pass_acceptance(4, 1) == 0.5  # the draft after the rejection was never tested
    assert pass_acceptance(4, 4) == acceptance_rate(4, 4) == 1.0


def test_expected_tokens_per_pass() -> None:
    assert expected_tokens(0, 0.9) == 1.0
    assert expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(7, 1.0) == pytest.approx(8, rel=0.01)


def test_best_length_is_plain_when_drafting_is_slow_or_rarely_right() -> None:
    cheap = Costs(plain=1.0, position=0.05, draft=0.0)
    assert best_length(0.9, cheap, 7) == 7
    assert best_length(0.02, cheap, 7) == 0  # low acceptance: plain steps
    slow = Costs(plain=1.0, position=0.05, draft=0.6)  # a drafted token: 0.6 of a step
    assert best_length(0.57, slow, 7) == 0
    assert best_length(0.95, slow, 7) > 0  # ... unless nearly every draft is right
    medium = Costs(plain=1.0, position=0.1, draft=0.15)
    k = best_length(0.6, medium, 7)
    assert 1 <= k < 7
    assert tokens_per_s(k, 0.6, medium) > tokens_per_s(0, 0.6, medium)
    assert best_length(0.02, cheap, 7, least=1) == 1  # a forced probe drafts the best k >= 1


def _passes(length: DraftLength, n: int, accept: float, costs: Costs) -> list[int]:
    """Run ``n`` passes whose measured times follow ``costs`` and whose drafts are accepted
    at ``accept`` (the first ``round(accept * k)`` of ``k``); the lengths chosen."""
    chosen = []
    for _ in range(n):
        k = length.k
        chosen.append(k)
        warm = length.warm
        draft_s = costs.draft * k if warm else None
        length.record(k, round(accept * k), draft_s, costs.plain + costs.position * k)
    return chosen


def test_a_generation_measures_a_plain_step_first_then_drafts_where_it_pays() -> None:
    length = DraftLength(7, Throughput(), "lookup")
    cheap = Costs(plain=1.0, position=0.05, draft=0.001)
    chosen = _passes(length, 12, 1.0, cheap)
    assert chosen[0] == 0  # nothing timed yet: a plain step
    assert chosen[-1] == 7 and length.rate > 0.95


def test_a_slow_drafter_falls_back_to_plain_steps_and_probes_ever_less_often() -> None:
    length = DraftLength(7, Throughput(), "draft", probe=8, max_probe=32)
    slow = Costs(plain=1.0, position=0.1, draft=0.8)
    chosen = _passes(length, 200, 0.5, slow)
    assert chosen[0] == 0 and chosen[1] > 0  # plain timed; then drafting is tried
    assert sum(k > 0 for k in chosen) < 0.1 * len(chosen)  # mostly plain steps
    assert length.probe == 32  # each losing probe doubled the wait
    assert chosen[-40:].count(0) >= 36


def test_the_length_adapts_when_the_measured_times_change() -> None:
    throughput = Throughput()
    length = DraftLength(7, throughput, "draft", probe=4, max_probe=8)
    fast = Costs(plain=1.0, position=0.05, draft=0.05)
    assert _passes(length, 30, 0.8, fast)[-1] > 0
    loaded = Costs(plain=1.0, position=0.3, draft=1.5)  # drafting now costs more than a step
    assert _passes(length, 60, 0.8, loaded)[-10:].count(0) >= 8
    assert _passes(length, 60, 0.8, fast)[-5:].count(0) <= 1  # a probe saw it pay again


def test_a_drafting_generation_refreshes_the_plain_step_time() -> None:
    length = DraftLength(7, Throughput(), "lookup", refresh=16)
    chosen = _passes(length, 60, 1.0, Costs(plain=1.0, position=0.05, draft=0.0))
    assert 1 <= chosen[10:].count(0) <= 4  # one plain step every 16 drafting passes


def test_the_deployment_s_estimates_are_shared_by_its_generations() -> None:
    throughput = Throughput()
    first = DraftLength(7, throughput, "draft")
    _passes(first, 30, 1.0, Costs(plain=1.0, position=0.05, draft=0.01))
    later = DraftLength(7, throughput, "draft")
    assert later.rate > 0.9 and later.k == 7  # no plain step to time first
    assert DraftLength(7, throughput, "lookup").rate == pytest.approx(0.5)  # per drafter kind
    costs = throughput.costs("draft")
    assert costs is not None and costs.position == pytest.approx(0.05)
    assert costs.draft == pytest.approx(0.01)


def test_a_pass_that_drafted_nothing_times_a_plain_step() -> None:
    throughput = Throughput()
    throughput.record_pass(1, 2.0)
    throughput.record_pass(1, 1.0)
    costs = throughput.costs("draft")
    assert costs is not None and costs.plain == pytest.approx(1.7)
    throughput.record_pass(5, 3.7)
    costs = throughput.costs("draft")
    assert costs is not None and costs.position == pytest.approx(0.5)


def test_a_lone_stream_is_priced_by_lone_passes_not_by_four_streams_before_it() -> None:
    throughput = Throughput()
    with throughput.generating():
        _passes(DraftLength(7, throughput, "draft"), 30, 0.8, Costs(1.0, 0.05, 0.05))
    with contextlib.ExitStack() as streams:
        for _ in range(4):
            streams.enter_context(throughput.generating())
        _passes(DraftLength(7, throughput, "draft"), 30, 0.8, Costs(3.0, 3.0, 0.2))
        busy = throughput.costs("draft")
        assert busy is not None and busy.plain > 2.0 and busy.position > 2.0
        assert best_length(0.8, busy, 7) == 0  # under four streams drafting does not pay
    with throughput.generating():
        alone = throughput.costs("draft")
        assert alone is not None and alone.plain < 1.5 and alone.position < 0.5
        assert best_length(throughput.rate("draft"), alone, 7) > 1
    assert throughput.rate("draft") > 0.7  # the acceptance is shared by every load


def test_a_generation_after_a_busy_spell_times_its_own_drafts() -> None:
    throughput = Throughput()
    busy = DraftLength(7, throughput, "draft")
    _passes(busy, 30, 0.8, Costs(plain=1.0, position=0.05, draft=2.0))  # drafts cost 2 steps
    costs = throughput.costs("draft")
    assert costs is not None and costs.draft > 1.5
    assert best_length(0.8, costs, 7) == 0  # the deployment's estimate says: do not draft
    quiet = Costs(plain=1.0, position=0.05, draft=0.05)
    alone = DraftLength(7, throughput, "draft")
    chosen = _passes(alone, 12, 0.8, quiet)
    assert chosen[:2] != [0, 0]  # it starts with a probe
    assert chosen[2:].count(0) <= 1  # and, having timed its own drafts, keeps drafting


def test_a_stretch_of_rejections_does_not_stop_a_drafter_that_pays_in_the_long_run() -> None:
    costs = Costs(plain=1.0, position=0.25, draft=0.25)  # one drafted token pays above 0.5
    throughput = Throughput()
    _passes(DraftLength(7, throughput, "draft"), 200, 0.8, costs)  # a long run at 0.8
    assert throughput.long_rate("draft") > 0.7
    length = DraftLength(7, throughput, "draft")
    hard = _passes(length, 6, 0.0, costs)  # six passes with every draft rejected
    assert length.rate < 0.2 and best_length(length.rate, costs, 7) == 0
    assert hard[-3:] == [1, 1, 1]  # it keeps drafting one token
    assert throughput.long_rate("draft") > 0.6

    fresh = Throughput()  # a drafter never known to pay
    _passes(DraftLength(7, fresh, "draft"), 200, 0.1, costs)
    assert fresh.long_rate("draft") < 0.5
    assert _passes(DraftLength(7, fresh, "draft"), 20, 0.1, costs)[4:].count(0) >= 12
