"""Drafters for speculative decoding: cheap guesses of the next tokens, checked by the chain.

:class:`PromptLookup` drafts by n-gram match against the text so far (the prompt and what has
been generated): when the last ``n`` tokens occurred before, it proposes the tokens that
followed them then. It needs no extra model and pays off where the output repeats the input
(code editing, summarising, quoting). The draft model (:mod:`coordinator.generation.draft_model`)
is the other drafter; :class:`LookupThenModel` combines the two (``speculative: auto`` with a
draft model). :class:`DraftLength` picks how many tokens to draft from the acceptance rate and
the cost of drafting measured so far.
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


class PromptLookup:
    """Prompt-lookup drafting: the most recent earlier occurrence of the longest matching
    suffix n-gram (``max_ngram`` down to ``min_ngram`` tokens) proposes what followed it."""

    blocking = False

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self._max = max_ngram
        self._min = min_ngram

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

    def propose(self, tokens: Sequence[int], count: int) -> list[int]:
        """The lookup's draft if it has one, else the model's."""
        return self._lookup.propose(tokens, count) or self._model.propose(tokens, count)


class DraftLength:
    """How many tokens to draft next, from the measured acceptance rate.

    With a per-token acceptance rate ``a``, drafting ``k`` tokens yields on average
    ``(1 - a**(k+1)) / (1 - a)`` tokens per pass, and a pass over ``k + 1`` positions costs
    about ``1 + cost * k`` single-token passes (a stage reads its weights once per pass; the
    extra positions cost compute). The length is the ``k`` in ``[1, limit]`` with the best
    ratio; the rate is an exponential moving average over drafted tokens. A drafter that takes
    time (a draft model) adds its measured time per drafted token, relative to a verifying
    pass, to ``cost`` (:meth:`observe`). When even the best ratio does not beat a plain step,
    nothing is drafted, except once every ``probe_every`` passes, so a text that starts
    repeating itself is noticed.
    """

    def __init__(
        self,
        limit: int,
        cost: float = 0.2,
        start_rate: float = 0.5,
        smoothing: float = 0.3,
        probe_every: int = 8,
    ) -> None:
        if limit < 1:
            raise ValueError(f"the draft length limit must be at least 1, got {limit}")
        self.limit = limit
        self.cost = cost
        self.verify_cost = cost
        self.rate = start_rate
        self._smoothing = smoothing
        self._probe_every = probe_every
        self._undrafted = 0

    def update(self, drafted: int, accepted: int) -> None:
        """Record one pass: ``accepted`` of its ``drafted`` tokens were kept."""
        if drafted <= 0:
            self._undrafted += 1
            return
        self._undrafted = 0
        # the acceptance of each drafted token up to the first rejection
        observed = accepted / min(drafted, accepted + 1)
        self.rate += self._smoothing * (observed - self.rate)

    def observe(self, drafted: int, draft_s: float, pass_s: float) -> None:
        """Record what drafting ``drafted`` tokens took against a verifying pass's time."""
        if drafted <= 0 or pass_s <= 0:
            return
        target = self.verify_cost + draft_s / drafted / pass_s
        self.cost += self._smoothing * (target - self.cost)

    @property
    def k(self) -> int:
        """The draft length to use next (0: a plain step)."""
        best = max(range(1, self.limit + 1), key=lambda k: self._gain(k))
        if self._gain(best) > 1.0 or self._undrafted >= self._probe_every:
            return best
        return 0

    def _gain(self, k: int) -> float:
        a = min(self.rate, 0.999)
        return (1 - a ** (k + 1)) / (1 - a) / (1 + self.cost * k)
