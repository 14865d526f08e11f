"""How many tokens to draft, from measured throughput: ``k`` in ``0..limit`` (0: a plain step).

A pass that feeds the last token and ``k`` drafts yields on average
``(1 - a**(k+1)) / (1 - a)`` tokens (``a``: the per-token acceptance rate) and takes
``plain + k * (position + draft)`` seconds: ``plain`` is a plain step's measured wall time,
``position`` the measured extra time of each further verified position and ``draft`` the
measured time to draft one token. :func:`best_length` picks the ``k`` with the most tokens per
second; ``k = 0`` (one token per ``plain``) wins whenever drafting does not pay.

The times are running averages per deployment and number of generations in flight
(:class:`Throughput`: what load does to a pass is the same for every generation, and a pass
among four streams' passes takes longer than a lone one), the draft time and a starting
acceptance rate per drafter kind; each generation tracks its own acceptance rate
(:class:`DraftLength`: it depends on the text) and, once it has timed a draft of its own, its
own drafting time: a draft is timed only while drafting, so the figure at its load may date
from a busier spell. So the estimates stay fresh, every generation starts with a probe (a draft
whatever the estimates say), one that steps plainly probes a draft now and then (less often
while probes keep losing) and one that drafts takes a plain step now and then.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

SMOOTHING = 0.3
"""Weight of a new measurement in the running averages."""
LONG_SMOOTHING = 0.03
"""Weight of a pass's acceptance in a drafter's long-run rate (its last hundred or so passes)."""
START_RATE = 0.5
"""Acceptance rate assumed before any draft was verified."""
MAX_LOAD = 4
"""Generations in flight from which on a deployment's pass times are kept together."""
START_POSITION = 0.2
"""Extra time of a verified position, as a share of a plain step, before it was measured."""


@dataclass(frozen=True)
class Costs:
    """Measured wall times, in seconds."""

    plain: float
    """One plain step (one position through the chain)."""
    position: float
    """Each further position a verifying pass carries."""
    draft: float
    """Drafting one token."""


def expected_tokens(k: int, acceptance: float) -> float:
    """Mean tokens a pass with ``k`` drafts yields (the accepted ones, then one more)."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


def tokens_per_s(k: int, acceptance: float, costs: Costs) -> float:
    """Expected tokens per second of passes with ``k`` drafts."""
    seconds = costs.plain + k * (costs.position + costs.draft)
    return expected_tokens(k, acceptance) / max(seconds, 1e-9)


def best_length(acceptance: float, costs: Costs, limit: int, least: int = 0) -> int:
    """The ``k`` in ``least..limit`` with the most expected tokens per second (the smallest
    on a tie)."""
    return max(range(least, limit + 1), key=lambda k: (tokens_per_s(k, acceptance, costs), -k))


def _average(old: float | None, new: float, weight: float = SMOOTHING) -> float:
    return new if old is None else old + weight * (new - old)


def acceptance_rate(drafted: int, accepted: int) -> float | None:
    """The share of ``drafted`` tokens the target kept (``accepted``), over any number of
    passes; None before any draft. The figure the console and the benchmarks report.

    The draft length follows :func:`pass_acceptance` instead: one pass's estimate of the
    per-token rate ``a`` of the model above, which counts no draft after the first rejection.
    """
    return accepted / drafted if drafted else None


def pass_acceptance(drafted: int, accepted: int) -> float:
    """One pass's estimate of the per-token acceptance rate ``a``: each drafted token up to the
    first rejection (the drafts after it were never put to the test)."""
    return accepted / min(drafted, accepted + 1)


@dataclass
class _PassTimes:
    """Running averages of pass and drafting times at one load."""

    plain: float | None = None
    position: float | None = None
    draft: dict[str, float] = field(default_factory=dict)


class Throughput:
    """One deployment's measured pass times and acceptance, shared by its generations.

    Times are kept apart by how many generations are in flight (1 to :data:`MAX_LOAD`, counted
    by :meth:`generating`): with other streams' passes between its stages a pass takes longer,
    so four streams' times must not price a lone stream's drafts after them. Acceptance rates
    depend on the text, not the load, and are shared."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._times: dict[int, _PassTimes] = {}
        self._rate: dict[str, float] = {}
        self._long_rate: dict[str, float] = {}
        self._in_flight = 0

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Count one generation in flight while the block runs."""
        with self._lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1

    def _now(self) -> _PassTimes:
        """The times at the current load (call under the lock)."""
        load = min(max(self._in_flight, 1), MAX_LOAD)
        return self._times.setdefault(load, _PassTimes())

    def record_pass(self, positions: int, seconds: float) -> None:
        """A verifying pass of ``positions`` positions took ``seconds`` (drafting excluded)."""
        if seconds <= 0 or positions < 1:
            return
        with self._lock:
            times = self._now()
            if positions == 1:
                times.plain = _average(times.plain, seconds)
            elif times.plain is not None:
                extra = max(seconds - times.plain, 0.0) / (positions - 1)
                times.position = _average(times.position, extra)

    def record_draft(self, kind: str, drafted: int, accepted: int, seconds: float | None) -> None:
        """``kind`` drafted ``drafted`` tokens (in ``seconds``, None: not a usual call, such as
        the first, which prefills the prompt) and ``accepted`` of them were kept."""
        if drafted <= 0:
            return
        with self._lock:
            rate = pass_acceptance(drafted, accepted)
            self._rate[kind] = _average(self._rate.get(kind), rate)
            self._long_rate[kind] = _average(
                self._long_rate.get(kind, START_RATE), rate, LONG_SMOOTHING
            )
            if seconds is not None:
                draft = self._now().draft
                draft[kind] = _average(draft.get(kind), max(seconds, 0.0) / drafted)

    def rate(self, kind: str) -> float:
        """The running acceptance rate of ``kind``'s drafts."""
        with self._lock:
            return self._rate.get(kind, START_RATE)

    def long_rate(self, kind: str) -> float:
        """``kind``'s acceptance rate over its last hundred or so passes: what a stretch of
        rejections in one generation does not move much."""
        with self._lock:
            return self._long_rate.get(kind, START_RATE)

    def costs(self, kind: str) -> Costs | None:
        """The measured costs for ``kind`` at the current load (None before a plain step was
        timed at it); what is not measured yet is assumed cheap, so that a draft is tried and
        measured."""
        with self._lock:
            times = self._now()
            if times.plain is None:
                return None
            position = START_POSITION * times.plain if times.position is None else times.position
            return Costs(times.plain, position, times.draft.get(kind, 0.0))


class DraftLength:
    """One generation's draft lengths (see the module docstring).

    A generation steps plainly until a plain step is timed; then every pass drafts
    :func:`best_length` tokens at the generation's own acceptance rate, and at least one
    while the drafter's long-run rate (:meth:`Throughput.long_rate`) makes one pay: a model
    drafter's acceptance comes in stretches, and a generation that stepped plainly after a few
    rejections would learn of the next easy stretch only at its next probe. Two exceptions
    keep the estimates fresh: at its start and after ``probe`` plain passes in a row it drafts
    anyway for ``PROBE_PASSES`` passes (the best ``k >= 1``; the first drafting pass after
    plain steps is not timed, since a draft model then catches up on the text it skipped; each
    probe after which plain steps still win doubles the wait, up to ``max_probe``), and after
    ``refresh`` drafting passes in a row it steps plainly once. Its drafting time is its own
    once it has timed one.
    """

    PROBE_PASSES = 2

    def __init__(
        self,
        limit: int,
        throughput: Throughput,
        kind: str,
        probe: int = 8,
        max_probe: int = 64,
        refresh: int = 16,
    ) -> None:
        if limit < 0:
            raise ValueError(f"the draft length limit must be at least 0, got {limit}")
        self.limit = limit
        self.throughput = throughput
        self.kind = kind
        self.rate = throughput.rate(kind)
        self.probe = probe
        self._probe_base = probe
        self._max_probe = max_probe
        self._refresh = refresh
        self._plain_run = 0
        self._draft_run = 0
        self._probing = self.PROBE_PASSES
        self._draft: float | None = None
        """This generation's drafting time per token (None until it timed a draft)."""

    @property
    def k(self) -> int:
        """The draft length of the next pass (0: a plain step)."""
        costs = self._costs()
        if costs is None or self.limit == 0:
            return 0
        if self._probing > 0:
            return best_length(self.rate, costs, self.limit, least=1)
        best = best_length(self.rate, costs, self.limit)
        if best == 0 and best_length(self.throughput.long_rate(self.kind), costs, 1) == 1:
            best = 1  # a few rejections in a row do not stop a drafter that pays in the long run
        if best > 0 and self._draft_run >= self._refresh:
            return 0
        return best

    @property
    def warm(self) -> bool:
        """Whether the last pass drafted (so the next draft's time is the usual one)."""
        return self._draft_run > 0

    def record(self, drafted: int, accepted: int, draft_s: float | None, verify_s: float) -> None:
        """One pass: ``accepted`` of ``drafted`` drafts kept; drafting took ``draft_s`` (None:
        not to be timed) and the verifying pass ``verify_s``."""
        self.throughput.record_pass(1 + drafted, verify_s)
        if drafted <= 0:
            self._plain_run += 1
            self._draft_run = 0
            if self._plain_run >= self.probe:
                self._probing = self.PROBE_PASSES
            return
        self.throughput.record_draft(self.kind, drafted, accepted, draft_s)
        if draft_s is not None:
            self._draft = _average(self._draft, max(draft_s, 0.0) / drafted)
        self.rate = _average(self.rate, pass_acceptance(drafted, accepted))
        self._plain_run = 0
        self._draft_run += 1
        if self._probing > 0:
            self._probing -= 1
            if self._probing == 0:
                self._back_off()

    def _costs(self) -> Costs | None:
        """The deployment's measured costs, with this generation's own drafting time once it
        has one."""
        costs = self.throughput.costs(self.kind)
        if costs is None or self._draft is None:
            return costs
        return Costs(costs.plain, costs.position, self._draft)

    def _back_off(self) -> None:
        """After a probe: wait longer for the next one if plain steps still win."""
        costs = self._costs()
        if costs is not None and best_length(self.rate, costs, self.limit) == 0:
            self.probe = min(2 * self.probe, self._max_probe)
        else:
            self.probe = self._probe_base
