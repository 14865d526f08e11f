"""Choosing the next token from the top-k candidates a decoder returns (pure functions).

* ``temperature == 0``: greedy, the candidate with the largest logit.
* otherwise: softmax of ``logits / temperature`` over the k candidates, then nucleus (top-p)
  filtering: the smallest set of most likely candidates whose probabilities sum to at least
  ``top_p``, renormalised; then one draw from a per-request :class:`numpy.random.Generator`.

A request with a ``seed`` gets ``numpy.random.default_rng(seed)``, so the same seed, prompt and
model give the same tokens; without one the generator is seeded from the OS.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from coordinator.generation.backend import TopCandidates

_SEED_MODULUS = 1 << 64


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens."""

    temperature: float = 1.0
    """0 means greedy; OpenAI allows 0..2."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 keeps every candidate."""
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def make_rng(seed: int | None) -> np.random.Generator:
    """The request's random generator: reproducible for a seed (any int), fresh otherwise."""
    return np.random.default_rng(None if seed is None else seed % _SEED_MODULUS)


def greedy(candidates: TopCandidates) -> int:
    """The id with the largest logit (the first one on ties)."""
    return int(candidates.ids[int(np.argmax(candidates.logits))])


def probabilities(logits: NDArray[np.float32], temperature: float) -> NDArray[np.float64]:
    """Softmax of ``logits / temperature`` in float64 (``temperature > 0``)."""
    if temperature <= 0.0:
        raise ValueError("probabilities need a positive temperature")
    scaled = logits.astype(np.float64) / temperature
    scaled -= scaled.max()
    weights = np.exp(scaled)
    result: NDArray[np.float64] = weights / weights.sum()
    return result


def nucleus(probs: NDArray[np.float64], top_p: float) -> NDArray[np.float64]:
    """Keep the smallest most-likely set whose mass reaches ``top_p``; renormalised."""
    if top_p >= 1.0:
        return probs
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    keep = int(np.searchsorted(cumulative, top_p * cumulative[-1], side="left")) + 1
    filtered = np.zeros_like(probs)
    chosen = order[: min(keep, probs.size)]
    filtered[chosen] = probs[chosen]
    result: NDArray[np.float64] = filtered / filtered.sum()
    return result


def choose(candidates: TopCandidates, params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token id under ``params`` (greedy at temperature 0)."""
    if params.temperature == 0.0:
        return greedy(candidates)
    probs = nucleus(probabilities(candidates.logits, params.temperature), params.top_p)
    index = int(rng.choice(probs.size, p=probs))
    return int(candidates.ids[index])
