"""The agent's per-session state table: capacity, replays, context limit, timeouts, freeing."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.errors import (
    ContextLengthError,
    SessionLimitError,
    SessionRewindError,
    SessionStateError,
)
from edge_agent.runtime.checks import InputSpec
from edge_agent.runtime.sessions import SessionTable, check_session_fields, session_key
from protocols.decoder import StatePair
from protocols.manifest import SessionLimits

PAIRS = [StatePair(past=f"past.{i}.key", present=f"present.{i}.key") for i in range(2)]
SPECS = [InputSpec(f"past.{i}.key", "float32", (1, 2, "past", 4)) for i in range(2)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _table(clock: Clock, sessions: int = 2, context: int = 8) -> SessionTable:
    limits = SessionLimits(max_sessions=sessions, max_context=context, idle_timeout_s=30)
    return SessionTable(PAIRS, limits, SPECS, clock)


def _presents(step_feeds: dict[str, np.ndarray], q: int) -> dict[str, np.ndarray]:
    """What a model would return: each past grown by ``q`` tokens (filled with the position)."""
    out = {}
    for pair in PAIRS:
        past = step_feeds[pair.past]
        new = np.full((1, 2, q, 4), past.shape[2], np.float32)
        out[pair.present] = np.concatenate([past, new], axis=2)
    return out


def test_steps_feed_back_the_previous_presents() -> None:
    table = _table(Clock())
    step = table.begin_step("a|s1", 0)
    assert all(step.feeds[p.past].shape == (1, 2, 0, 4) for p in PAIRS)
    assert table.end_step(step, _presents(step.feeds, 3)) == 3
    step = table.begin_step("a|s1", 3)
    assert step.feeds["past.0.key"].shape == (1, 2, 3, 4)
    assert table.end_step(step, _presents(step.feeds, 1)) == 4
    assert table.state_bytes() == 2 * 2 * 4 * 4 * 4


def test_replayed_or_reordered_steps_are_refused_and_change_nothing() -> None:
    table = _table(Clock())
    step = table.begin_step("a|s1", 0)
    table.end_step(step, _presents(step.feeds, 3))
    with pytest.raises(SessionStateError, match="replayed"):
        table.begin_step("a|s1", 0)
    with pytest.raises(SessionStateError):
        table.begin_step("a|s1", 5)
    with pytest.raises(SessionStateError, match="unknown"):
        table.begin_step("b|s1", 3)  # another requester's view of the same id
    assert table.begin_step("a|s1", 3).position == 3


def test_a_full_table_refuses_new_sessions_until_one_ends() -> None:
    table = _table(Clock(), sessions=2)
    for key in ("a|1", "a|2"):
        step = table.begin_step(key, 0)
        table.end_step(step, _presents(step.feeds, 1))
    with pytest.raises(SessionLimitError, match="all 2 sessions"):
        table.begin_step("a|3", 0)
    assert table.end("a|1")
    assert not table.end("a|1")
    table.begin_step("a|3", 0)
    assert len(table) == 2


def test_a_step_past_the_context_is_refused_and_the_session_kept() -> None:
    table = _table(Clock(), context=4)
    step = table.begin_step("a|1", 0)
    table.end_step(step, _presents(step.feeds, 3))
    step = table.begin_step("a|1", 3)
    with pytest.raises(ContextLengthError, match="over the 4"):
        table.end_step(step, _presents(step.feeds, 2))
    assert table.begin_step("a|1", 3).feeds["past.1.key"].shape[2] == 3


def test_idle_sessions_time_out_and_failed_prefills_hold_no_slot() -> None:
    clock = Clock()
    table = _table(clock, sessions=2)
    step = table.begin_step("a|old", 0)
    table.end_step(step, _presents(step.feeds, 2))
    table.begin_step("a|failed", 0)
    table.discard("a|failed")
    assert len(table) == 1
    clock.now += 31
    assert table.expire() == ["a|old"]
    assert len(table) == 0 and table.state_bytes() == 0


def test_session_keys_and_fields() -> None:
    assert session_key("coordinator|req-7", "s1") == "coordinator|s1"
    assert check_session_fields(False, None, None, False) is None
    assert check_session_fields(False, "s", 0, False) == "this deployment keeps no sessions"
    assert check_session_fields(True, None, None, False) is None  # a one-shot request
    assert "session_id" in (check_session_fields(True, None, None, True) or "")
    assert "session_position" in (check_session_fields(True, "s", None, False) or "")
    assert check_session_fields(True, "s", None, True) is None


def test_a_rewind_cuts_every_state_back_and_the_step_continues_there() -> None:
    table = _table(Clock(), context=16)
    step = table.begin_step("a|s1", 0)
    table.end_step(step, _presents(step.feeds, 3))
    step = table.begin_step("a|s1", 3)
    table.end_step(step, _presents(step.feeds, 5))  # 3 + a verified draft of 5
    step = table.begin_step("a|s1", 5, rewind=True)  # two drafted tokens were rejected
    for pair in PAIRS:
        kept = step.feeds[pair.past]
        assert kept.shape == (1, 2, 5, 4)
        assert kept[0, 0, :, 0].tolist() == [0, 0, 0, 3, 3]
        assert not kept.flags.writeable
    assert table.end_step(step, _presents(step.feeds, 2)) == 7
    assert table.state_bytes() == 2 * 2 * 7 * 4 * 4


def test_a_rewind_past_what_the_session_held_is_refused_and_changes_nothing() -> None:
    table = _table(Clock())
    step = table.begin_step("a|s1", 0)
    table.end_step(step, _presents(step.feeds, 3))
    with pytest.raises(SessionRewindError, match="holds 3 tokens"):
        table.begin_step("a|s1", 4, rewind=True)
    with pytest.raises(SessionRewindError):
        table.truncate("a|s1", 9)
    with pytest.raises(SessionStateError, match="unknown"):
        table.truncate("b|s1", 0)
    step = table.begin_step("a|s1", 3, rewind=True)  # a rewind to the end changes nothing
    assert table.end_step(step, _presents(step.feeds, 1)) == 4


def test_rewind_needs_a_session_step() -> None:
    assert check_session_fields(True, "s", 3, False, rewind=True) is None
    assert "session_rewind" in (check_session_fields(True, None, None, False, rewind=True) or "")
    assert "session_rewind" in (check_session_fields(True, "s", None, True, rewind=True) or "")
