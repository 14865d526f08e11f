"""Step feeds of a decoder: the tensors one generation step sends through the chain.

Each step of a session carries only the new tokens with their attention mask and positions
(:mod:`protocols.decoder`). The deployer's health check of a decoder is a one-shot prefill (no
session): the sample prompt from an empty cache, compared with the same prefill run locally
(:func:`health_feeds`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from coordinator.errors import RequestError
from protocols.decoder import ATTENTION_MASK, INPUT_IDS, POSITION_IDS
from protocols.manifest import Manifest

Arrays = dict[str, np.ndarray[Any, Any]]


def step_inputs(position: int, token_ids: Sequence[int]) -> Arrays:
    """The frame tensors of one step: ``token_ids`` appended after ``position`` tokens."""
    if not token_ids:
        raise RequestError("a generation step needs at least one token")
    count = len(token_ids)
    return {
        INPUT_IDS: np.asarray(token_ids, dtype=np.int64).reshape(1, count),
        ATTENTION_MASK: np.ones((1, position + count), dtype=np.int64),
        POSITION_IDS: np.arange(position, position + count, dtype=np.int64).reshape(1, count),
    }


def state_names(manifest: Manifest) -> set[str]:
    """Every per-session state input and output of a split model."""
    return {n for s in manifest.segments for p in s.state for n in (p.past, p.present)}


def health_feeds(manifest: Manifest, samples: Mapping[str, Any]) -> tuple[Arrays, Arrays]:
    """For a decoder: the one-shot prefill sent through the chain, and the same prefill with
    empty caches for a local run (which gives the expected answer)."""
    prompt = np.asarray(samples[INPUT_IDS], dtype=np.int64).reshape(-1)
    wire = step_inputs(0, prompt.tolist())
    local = dict(wire)
    pasts = {p.past: p.axis for s in manifest.segments for p in s.state}
    for info in manifest.model.inputs:
        if info.name in pasts:
            shape = [
                0 if k == pasts[info.name] else (d if isinstance(d, int) and d > 0 else 1)
                for k, d in enumerate(info.shape)
            ]
            local[info.name] = np.zeros(shape, dtype=np.dtype(info.dtype))
    return wire, local
