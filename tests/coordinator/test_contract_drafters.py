"""The drafter's contract (:class:`coordinator.generation.drafters.Drafter`), held by every
implementation: prompt lookup, the draft model's stream (tiny-gemma3 drafting for tiny-llama,
real exports and ONNX Runtime) and lookup-then-model over each.

One suite parametrised over the drafters (as Flower tests every state of its links): nothing
is drafted when nothing is asked or there is no text; a draft is at most ``count`` token ids;
the caller's text is never changed; drafts depend only on the text (two fresh drafters agree,
reading the prompt ahead changes nothing, and a text cut back after rejected drafts is drafted
as a fresh drafter would).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from contract_helpers import implementations

from coordinator.generation.draft_model import DraftModel, DraftStream
from coordinator.generation.drafters import Drafter, LookupThenModel, PromptLookup

TEXT = [101, 7592, 2088, 1010, 2023, 2003, 1037, 3231, 1012, 7592, 2088, 1010, 2023]
"""Token ids below every test vocabulary, with a repeat (so that the lookup has a match)."""
VOCAB = 30522
"""The tiny exports' vocabulary (MiniLM's tokenizer): every draft is a token id below it."""

Make = Callable[[pytest.FixtureRequest], Drafter]


def _draft_model(request: pytest.FixtureRequest) -> DraftModel:
    """tiny-gemma3 as the draft model of tiny-llama (same tokenizer), once per module."""
    cached: DraftModel | None = getattr(request.module, "_DRAFT", None)
    if cached is None:
        llama: Path = request.getfixturevalue("tiny_llama_dir")
        gemma: Path = request.getfixturevalue("tiny_gemma3_dir")
        cached = DraftModel(gemma, llama)
        request.module._DRAFT = cached
    return cached


DRAFTERS: dict[str, Make] = {
    "lookup": lambda request: PromptLookup(),
    "lookup-bigram": lambda request: PromptLookup(max_ngram=2, min_ngram=2),
    "draft-model": lambda request: _draft_model(request).stream(),
    "lookup-then-model": lambda request: LookupThenModel(_draft_model(request).stream()),
    "lookup-then-lookup": lambda request: LookupThenModel(PromptLookup(max_ngram=1)),
}
NEEDS_EXPORTS = {"draft-model", "lookup-then-model"}


@pytest.fixture(
    params=[
        pytest.param(name, marks=[pytest.mark.slow] if name in NEEDS_EXPORTS else [])
        for name in sorted(DRAFTERS)
    ]
)
def fresh(request: pytest.FixtureRequest) -> Callable[[], Drafter]:
    """A maker of fresh drafters of one kind (one per generation, as the engine makes them)."""
    make = DRAFTERS[request.param]
    return lambda: make(request)


def test_blocking_says_whether_it_runs_off_the_loop(fresh: Callable[[], Drafter]) -> None:
    assert isinstance(fresh().blocking, bool)


def test_nothing_asked_or_no_text_drafts_nothing(fresh: Callable[[], Drafter]) -> None:
    drafter = fresh()
    assert drafter.propose(TEXT, 0) == []
    assert drafter.propose([], 4) == []


@pytest.mark.parametrize("count", [1, 3, 8])
def test_a_draft_is_at_most_count_token_ids(fresh: Callable[[], Drafter], count: int) -> None:
    drafts = fresh().propose(TEXT, count)
    assert len(drafts) <= count
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in drafts), drafts


def test_the_callers_text_is_never_changed(fresh: Callable[[], Drafter]) -> None:
    drafter, text = fresh(), list(TEXT)
    drafter.prepare(text)
    drafter.propose(text, 4)
    drafter.propose(text[:5], 4)
    assert text == TEXT


def test_drafts_depend_only_on_the_text(fresh: Callable[[], Drafter]) -> None:
    want = fresh().propose(TEXT, 4)
    assert fresh().propose(TEXT, 4) == want  # two fresh drafters agree
    prepared = fresh()
    prepared.prepare(TEXT[:-3])  # the prompt read ahead, the text grew since
    assert prepared.propose(TEXT, 4) == want
    rewound = fresh()
    rewound.propose([*TEXT, 5, 6, 7], 4)  # drafts after a longer text, then cut back
    assert rewound.propose(TEXT, 4) == want


def test_every_drafter_in_the_generation_room_is_in_the_suite() -> None:
    """A new drafter (a class of :mod:`coordinator.generation` with ``propose``, ``prepare``
    and ``blocking``) joins :data:`DRAFTERS`, so that it is held to the same contract."""
    found = implementations("coordinator.generation", ("propose", "prepare", "blocking"))
    assert found == {PromptLookup, DraftStream, LookupThenModel}, found
