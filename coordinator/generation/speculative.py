"""Speculative decoding over the chain: draft k tokens, verify them in one pass of every stage.

Each pass feeds the last chosen token and up to k drafted ones at the session's position; the
last stage returns the top-k candidates of each of those positions (the graph's
``trailing_top_*`` outputs, :mod:`protocols.decoder`). Drafted tokens are accepted in order:

* greedy (``temperature == 0``): while a draft equals the greedy choice at its position, so the
  text is the one plain greedy decoding gives, token for token;
* sampling: a draft ``d`` is kept with probability ``p(d)``, the target's probability after
  temperature and top-p (the drafters here are deterministic, so the draft distribution is a
  point mass and ``min(1, p/q)`` is ``p(d)``); on a rejection the token is drawn from ``p``
  without ``d``, renormalised. This is the standard speculative-sampling rule (Leviathan et
  al. 2023, Chen et al. 2023), so every token has the plain sampler's distribution (the random
  draws differ, so a seeded request gets other, equally likely, text).

Every pass yields the accepted drafts plus one token chosen from the candidates after them, so
a pass never yields less than a plain step. The next pass tells every stage to *rewind* the
session to the accepted length (``session_rewind``), dropping the rejected positions' cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import anyio
import numpy as np

from coordinator.generation.backend import TopCandidates
from coordinator.generation.draft_model import DraftModel
from coordinator.generation.drafters import Drafter, LookupThenModel, PromptLookup
from coordinator.generation.sampling import SamplingParams, choose, greedy, nucleus, probabilities
from coordinator.generation.tuning import DraftLength, Throughput, acceptance_rate

log = logging.getLogger(__name__)

Speculative = Literal["off", "lookup", "draft", "auto"]
"""A decoder's speculative decoding (see :mod:`coordinator.generation.speculative`)."""


@runtime_checkable
class VerifyingBackend(Protocol):
    """A backend that can verify drafted tokens in one pass (see the module docstring)."""

    async def verify(
        self, session: str, position: int, token_ids: Sequence[int]
    ) -> list[TopCandidates]:
        """Append ``token_ids`` at ``position`` after cutting ``session`` back to
        ``position`` tokens (it may hold more: rejected drafts); the candidates after each of
        ``token_ids``, in order."""
        ...


Drafters = Callable[[], Drafter]
"""Makes the drafter of one generation."""


def drafter_for(mode: Speculative, draft: DraftModel | None = None) -> Drafters | None:
    """What makes a mode's drafters, or None for no speculation.

    * ``lookup``: prompt lookup;
    * ``draft``: the draft model (prompt lookup when the model has none);
    * ``auto``: with a draft model, prompt lookup where it finds an n-gram of two or more
      tokens and the draft model elsewhere (:class:`LookupThenModel`); without one, prompt
      lookup. Either way the draft length follows the measured acceptance rate and pass and
      drafting times, down to plain steps when drafting does not pay
      (:mod:`coordinator.generation.tuning`).
    """
    if mode == "off":
        return None
    if draft is None or mode == "lookup":
        return PromptLookup
    if mode == "draft":
        return draft.stream
    return lambda: LookupThenModel(draft.stream())


def accept(
    drafts: Sequence[int],
    candidates: Sequence[TopCandidates],
    params: SamplingParams,
    rng: np.random.Generator,
) -> list[int]:
    """The tokens one verified pass yields: the accepted drafts, then one more.

    ``candidates[i]`` is what the target model predicts after the i-th fed token (the last
    chosen one, then each draft), so ``len(candidates) == len(drafts) + 1``.
    """
    if len(candidates) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} candidate sets")
    out: list[int] = []
    for draft, cands in zip(drafts, candidates, strict=False):
        if params.temperature == 0.0:
            token = greedy(cands)
            out.append(token)
            if token != draft:
                return out
            continue
        probs = nucleus(probabilities(cands.logits, params.temperature), params.top_p)
        hit = cands.ids == draft
        if rng.random() < float(probs[hit].sum()):
            out.append(draft)
            continue
        residual = np.where(hit, 0.0, probs)
        out.append(int(cands.ids[int(rng.choice(residual.size, p=residual / residual.sum()))]))
        return out
    out.append(choose(candidates[-1], params, rng))
    return out


def trailing_candidates(logits: np.ndarray, ids: np.ndarray, count: int) -> list[TopCandidates]:
    """The candidates after each of a pass's last ``count`` tokens, from the graph's
    ``trailing_top_logits``/``trailing_top_ids`` (``[1, min(q, W), top_k]``)."""
    if logits.ndim != 3 or logits.shape != ids.shape or logits.shape[1] < count:
        raise ValueError(
            f"trailing top-k of shape {logits.shape} / {ids.shape} cannot give {count} positions"
        )
    rows = range(logits.shape[1] - count, logits.shape[1])
    return [TopCandidates.of(logits[0, row], ids[0, row]) for row in rows]


class SpeculationStats:
    """Per-model counters the console shows: acceptance rate and decode tokens/s."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.passes = 0
        self.drafted = 0
        self.accepted = 0
        self.tokens = 0
        self.seconds = 0.0
        self.throughput = Throughput()
        """Measured pass times and acceptance: what the draft length follows."""

    def record(self, drafted: int, accepted: int, tokens: int, seconds: float) -> None:
        """One verified pass: ``tokens`` yielded in ``seconds`` of chain time."""
        with self._lock:
            self.passes += 1
            self.drafted += drafted
            self.accepted += accepted
            self.tokens += tokens
            self.seconds += seconds

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted tokens (None before any draft): :func:`acceptance_rate`."""
        with self._lock:
            return acceptance_rate(self.drafted, self.accepted)

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens yielded per second of verifying passes (None before any pass)."""
        with self._lock:
            return self.tokens / self.seconds if self.seconds > 0 else None


@dataclass(frozen=True)
class Speculation:
    """How one model speculates: its drafters, the most tokens a pass verifies, its stats."""

    drafters: Drafters
    max_positions: int
    """The graph's ``trailing_positions``: a pass feeds at most this many tokens."""
    stats: SpeculationStats


async def speculative_tokens(
    backend: VerifyingBackend,
    session: str,
    context: list[int],
    first: TopCandidates,
    budget: int,
    params: SamplingParams,
    rng: np.random.Generator,
    speculation: Speculation,
    drafter: Drafter,
) -> AsyncGenerator[int, None]:
    """The generated tokens of ``session`` (whose stages hold the prompt ``context``, with
    ``first`` the candidates after it), at most ``budget`` of them, verified in passes with
    ``drafter``'s drafts (one of ``speculation.drafters()``)."""
    held = len(context)
    context = [*context, choose(first, params, rng)]
    yield context[-1]
    produced = 1
    throughput = speculation.stats.throughput
    length = DraftLength(speculation.max_positions - 1, throughput, type(drafter).__name__)
    with throughput.generating():  # its passes are timed at the load they run under
        while produced < budget:
            count = min(length.k, budget - produced - 1)
            warm = length.warm  # a draft after plain steps catches up first: not its usual time
            start = time.perf_counter()
            drafts = (await _propose(drafter, context, count))[:count]
            drafted = time.perf_counter()
            candidates = await backend.verify(session, held, [context[-1], *drafts])
            tokens = accept(drafts, candidates, params, rng)
            accepted = len(tokens) - 1
            done = time.perf_counter()
            speculation.stats.record(len(drafts), accepted, len(tokens), done - start)
            length.record(len(drafts), accepted, drafted - start if warm else None, done - drafted)
            held += 1 + accepted
            for token in tokens:
                context.append(token)
                produced += 1
                yield token


async def prefill_with_drafter(
    prefill: Callable[[], Awaitable[TopCandidates]], drafter: Drafter, prompt: Sequence[int]
) -> TopCandidates:
    """The chain's ``prefill`` while ``drafter`` reads ``prompt`` (off the event loop when it
    takes time), so the two prefills overlap; both are done when this returns. The prefill's
    errors propagate as they are; a drafter that cannot read the prompt is logged and left to
    catch up when it first drafts."""
    if not drafter.blocking:
        drafter.prepare(prompt)
        return await prefill()
    failure: Exception | None = None
    async with anyio.create_task_group() as group:
        group.start_soon(_read_ahead, drafter, list(prompt))
        try:
            candidates = await prefill()
        except Exception as exc:  # raised below, outside the group (which would wrap it)
            failure = exc
    if failure is not None:
        raise failure
    return candidates


async def _read_ahead(drafter: Drafter, prompt: list[int]) -> None:
    try:
        await anyio.to_thread.run_sync(drafter.prepare, prompt)
    except Exception:  # drafting is an optimisation: the generation goes on without it
        log.warning("the drafter could not read the prompt ahead", exc_info=True)


async def _propose(drafter: Drafter, context: list[int], count: int) -> list[int]:
    """The drafter's proposal, off the event loop when it takes time (a model)."""
    if count < 1:
        return []
    if drafter.blocking:
        snapshot = list(context)
        return await anyio.to_thread.run_sync(drafter.propose, snapshot, count)
    return drafter.propose(context, count)
