"""Shard-wise FedAvg, as pure numpy functions.

The global parameter vector is the concatenation of every trainable shard's arrays. A client that
trains only some shards sends the others back unchanged, so all replies share one layout (which
SecAgg+ needs: it sums vectors) and the securely computed weighted average over *all* clients is

    A_s = g_s + sum_{i trains s} r_i (w_is - g_s) / R,      R = sum_i r_i.

Shard-wise FedAvg wants the average over the clients that trained ``s`` only,

    g'_s = g_s + sum_{i trains s} r_i (w_is - g_s) / R_s,   R_s = sum_{i trains s} r_i,

so ``g'_s = g_s + (A_s - g_s) * R / R_s``: the server recovers it from the secure sum and the
public weights and shard assignments, without seeing any single client's update. Under DP the
noise is added to ``A`` first; the rescale is post-processing and keeps the guarantee.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShardLayout:
    """Which shard (segment index) each array of the parameter list belongs to."""

    shard_of_array: tuple[int, ...]

    @classmethod
    def from_counts(cls, shards: Sequence[int], counts: Sequence[int]) -> ShardLayout:
        """Layout of ``counts[k]`` consecutive arrays for each shard ``shards[k]``."""
        owner: list[int] = []
        for shard, count in zip(shards, counts, strict=True):
            owner.extend([shard] * count)
        return cls(tuple(owner))

    @property
    def shards(self) -> list[int]:
        """The shards, in layout order."""
        return list(dict.fromkeys(self.shard_of_array))


def weighted_average(
    arrays: Sequence[Sequence[np.ndarray]], weights: Sequence[float]
) -> list[np.ndarray]:
    """Plain FedAvg: the ``weights``-weighted mean of each array over the clients."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("the weights must sum to a positive number")
    out = []
    for k in range(len(arrays[0])):
        acc = np.zeros(np.shape(arrays[0][k]), dtype=np.float64)
        for client, w in zip(arrays, weights, strict=True):
            acc += w * np.asarray(client[k], dtype=np.float64)
        out.append(acc / total)
    return out


def shardwise_rescale(
    global_arrays: Sequence[np.ndarray],
    averaged: Sequence[np.ndarray],
    weights: Sequence[float],
    trained: Sequence[frozenset[int]],
    layout: ShardLayout,
) -> list[np.ndarray]:
    """Turn the all-client average ``averaged`` into the shard-wise average (see module doc).

    A shard nobody trained keeps its global value.
    """
    total = float(sum(weights))
    out = []
    for k, (g, a) in enumerate(zip(global_arrays, averaged, strict=True)):
        shard = layout.shard_of_array[k]
        shard_total = float(sum(w for w, t in zip(weights, trained, strict=True) if shard in t))
        g64 = np.asarray(g, dtype=np.float64)
        if shard_total <= 0:
            out.append(g64.astype(np.asarray(g).dtype))
            continue
        new = g64 + (np.asarray(a, dtype=np.float64) - g64) * (total / shard_total)
        out.append(new.astype(np.asarray(g).dtype))
    return out


def shardwise_fedavg(
    global_arrays: Sequence[np.ndarray],
    client_arrays: Sequence[Sequence[np.ndarray]],
    weights: Sequence[float],
    trained: Sequence[frozenset[int]],
    layout: ShardLayout,
) -> list[np.ndarray]:
    """Reference: average each shard directly over the clients that trained it."""
    out = []
    for k, g in enumerate(global_arrays):
        shard = layout.shard_of_array[k]
        members = [
            (c[k], w) for c, w, t in zip(client_arrays, weights, trained, strict=True) if shard in t
        ]
        if not members:
            out.append(np.asarray(g).copy())
            continue
        total = sum(w for _, w in members)
        mean = sum(w * np.asarray(a, dtype=np.float64) for a, w in members) / total
        out.append(np.asarray(mean).astype(np.asarray(g).dtype))
    return out


def parse_shards(text: str) -> frozenset[int]:
    """Parse the ``trained-shards`` metric ("2,3" or "")."""
    return frozenset(int(part) for part in text.split(",") if part.strip())
