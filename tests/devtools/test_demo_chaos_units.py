"""Unit: the chaos run's reading of failover events, and the supervisor's narration."""

from __future__ import annotations

from dataclasses import dataclass, field

from devtools.demo.chaos import _timeline
from devtools.demo.supervise import FailoverNote

KILLED = 1000.0
ABCD = frozenset("abcd")


@dataclass
class FakeSupervisor:
    restarts: dict[str, float] = field(default_factory=dict)


def note(at: float, kind: str, model: str | None = None, version: int | None = None, **kw: str):
    """A failover note; its plan version (the agents' key) and model version are alike here."""
    return FailoverNote(at, kind, kw.get("device"), model, version, kw.get("detail", ""), version)


def test_a_model_that_shrank_must_expand_after_the_restart() -> None:
    notes = [
        note(KILLED - 5, "expanded", "m", 1),  # before the kill: not this chaos run's
        note(KILLED + 0.5, "lost", device="a"),
        note(KILLED + 3, "replanned", "m", 2),
        note(KILLED + 9, "back", device="a"),
        note(KILLED + 20, "expanded", "m", 3),
    ]
    plans = {"m": {1: ABCD, 2: frozenset("bcd"), 3: ABCD}}
    sup = FakeSupervisor({"a": KILLED + 8})
    t = _timeline(notes, plans, "a", {"m": 4}, KILLED, sup)  # type: ignore[arg-type]
    assert t.notice_s == 0.5
    assert t.replan_s == {"m": 3.0}
    assert t.expand_s == {"m": 12.0}
    assert t.rejoin_s == 1.0
    assert t.settled


def test_no_expand_yet_is_not_settled_and_an_unavailable_model_counts_as_shrunk() -> None:
    notes = [note(KILLED + 1, "lost", device="a"), note(KILLED + 2, "unavailable", "m", 1)]
    t = _timeline(notes, {"m": {1: frozenset("ab")}}, "a", {"m": 2}, KILLED, FakeSupervisor())  # type: ignore[arg-type]
    assert t.replan_s == {"m": 2.0}
    assert t.expand_s == {"m": None}
    assert not t.settled


def test_a_model_replanned_on_as_many_devices_has_nothing_to_expand() -> None:
    notes = [note(KILLED + 1, "lost", device="a"), note(KILLED + 4, "replanned", "d", 7)]
    plans = {"d": {6: frozenset("ab"), 7: frozenset("bc")}}
    t = _timeline(notes, plans, "a", {"d": 2}, KILLED, FakeSupervisor())  # type: ignore[arg-type]
    assert t.kept_whole == ["d"] and t.expand_s == {}
    assert not t.settled  # the device was never restarted, so it never rejoined


def test_a_replan_that_already_holds_the_restarted_victim_has_nothing_to_expand() -> None:
    """The victim came back while the re-plan ran, so the narrower plan includes it: the
    coordinator expands nothing, and the chaos run must not wait for it (CI saw it wait)."""
    notes = [
        note(KILLED + 0.5, "lost", device="a"),
        note(KILLED + 9, "back", device="a"),
        note(KILLED + 11, "replanned", "m", 2),
    ]
    plans = {"m": {1: ABCD, 2: frozenset("ab")}}
    sup = FakeSupervisor({"a": KILLED + 8})
    t = _timeline(notes, plans, "a", {"m": 4}, KILLED, sup)  # type: ignore[arg-type]
    assert t.kept_whole == ["m"] and t.expand_s == {}
    assert t.settled
    narrower = {"m": {1: ABCD, 2: frozenset("bc")}}  # without the victim it must expand
    assert not _timeline(notes, narrower, "a", {"m": 4}, KILLED, sup).settled  # type: ignore[arg-type]


def test_a_model_not_yet_replanned_is_not_settled() -> None:
    t = _timeline([], {}, "a", {"m": 3}, KILLED, FakeSupervisor())  # type: ignore[arg-type]
    assert t.notice_s is None and t.replan_s == {"m": None} and not t.settled


def test_sentences_name_the_device_and_the_version() -> None:
    assert note(1, "lost", device="nas").sentence() == "device nas lost"
    assert note(1, "replanned", "m", 4, detail="a, b").sentence() == (
        "m re-planned: now served by v4 (a, b)"
    )
    assert "503" in note(1, "unavailable", "m", 2).sentence()
