"""Drafters for speculative decoding: cheap guesses of the next tokens, checked by the chain.

:class:`PromptLookup` drafts by n-gram match against the text so far (the prompt and what has
been generated): when the last ``n`` tokens occurred before, it proposes the tokens that
followed them then. It needs no extra model and pays off where the output repeats the input
(code editing, summarising, quoting). The draft model (:mod:`coordinator.generation.draft_model`)
is the other drafter; :class:`LookupThenModel` combines the two (``speculative: auto`` with a
draft model). :mod:`coordinator.generation.tuning` picks how many tokens to draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

MAX_NGRAM = 3
"""Longest n-gram the lookup tries to match (longer matches are tried first)."""
SEARCH_WINDOW = 4096
"""Only the most recent tokens are searched (a long context would make every step slow)."""


class Drafter(Protocol):
    """Proposes up to ``count`` tokens to follow ``tokens``; one per generation (a drafter may
    keep state, such as a draft model's KV cache, between the calls of one generation)."""

    blocking: bool
    """Whether :meth:`propose` takes long enough to be run off the event loop."""

    def propose(self, tokens: Sequence[int], count: int) -> list[int]:
        """Drafted continuation of ``tokens`` (possibly empty, never longer than ``count``)."""
        ...

    def prepare(self, tokens: Sequence[int]) -> None:
        """Read ``tokens`` (the prompt) ahead of the first :meth:`propose`; the generation calls
        it while the chain reads the prompt, so a draft model's prefill overlaps the chain's."""
        ...


class PromptLookup:
    """Prompt-lookup drafting: the most recent earlier occurrence of the longest matching
    suffix n-gram (``max_ngram`` down to ``min_ngram`` tokens) proposes what followed it."""

    blocking = False

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self._max = max_ngram
        self._min = min_ngram

    def prepare(self, tokens: Sequence[int]) -> None:
        """Nothing to read ahead: the lookup searches the text when asked."""

    def propose(self, tokens: Sequence[int], count: int) -> list[int]:
        """Up to ``count`` tokens that followed an earlier copy of the text's last n-gram."""
        if count < 1:
            return []
        window = list(tokens[-SEARCH_WINDOW:])
        for size in range(min(self._max, len(window) - 1), self._min - 1, -1):
            tail = window[-size:]
            for start in range(len(window) - size - 1, -1, -1):
                if window[start : start + size] == tail:
                    return window[start + size : start + size + count]
        return []


class LookupThenModel:
    """Prompt lookup where the text repeats itself, the draft model elsewhere.

    A lookup match of at least ``min_ngram`` tokens drafts (free, and often right on editing
    prompts); without one, ``model`` drafts. The model's cache catches up on the text it did
    not draft the next time it is asked.
    """

    blocking = True

    def __init__(self, model: Drafter, min_ngram: int = 2) -> None:
        self._lookup = PromptLookup(min_ngram=min_ngram)
        self._model = model

    def prepare(self, tokens: Sequence[int]) -> None:
        """The model reads the prompt ahead."""
        self._model.prepare(tokens)

    def propose(self, tokens: Sequence[int], count: int) -> list[int]:
        """The lookup's draft if it has one, else the model's."""
        return self._lookup.propose(tokens, count) or self._model.propose(tokens, count)
