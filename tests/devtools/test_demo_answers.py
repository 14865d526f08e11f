"""The demo's held-out answer is cut at its stops after its leading blanks, not before."""

from __future__ import annotations

from devtools.demo.training import ANSWER_STOP, answer_text

STOPS = ("\nQuestion:", *ANSWER_STOP)


def test_a_leading_blank_line_does_not_cut_the_answer_to_nothing() -> None:
    text = "\n\nA small fish of the perch family.\n\nQuestion: What does cod mean?"
    assert answer_text(text, STOPS) == "A small fish of the perch family."


def test_the_first_stop_after_the_answer_ends_it() -> None:
    assert answer_text(" A bird.\nAnswer: a fish", STOPS) == "A bird."
    assert answer_text("A bird\nQuestion: x\n\ny", STOPS) == "A bird"
    assert answer_text("no stop at all ", STOPS) == "no stop at all"
    assert answer_text(" \n ", STOPS) == ""
