"""Whether a chain of GGUF segments decodes a pass of ``k`` tokens as ``k`` one-token steps.

Speculative decoding verifies ``k`` drafted tokens in one pass of every stage; its greedy text is
the text of plain decoding only where that pass gives each position's candidates, and every
position's keys and values, bit for bit as one-token steps do. The builder runs every float
product on at least two rows (:func:`~partitioner.models.decoders.rowwise.at_least_two_rows`)
so that it can; ``MatMulNBits`` does on the CPUs whose kernel computes a lone row as it computes
several. :class:`RowsProbe` checks it on the segments as built, one stage at a time (so a caller
holding one segment at a time, as the deploy does, probes the whole chain):

- after the prompt's prefill (whose presents the caller has), :data:`PROBE_TOKENS` are fed one
  a step, each step's presents becoming the next step's pasts;
- then passes of every length ``m`` from 2 to :data:`~protocols.decoder.TRAILING_POSITIONS`
  from the prefill's pasts, each held bit for bit against the first ``m`` steps: the hidden
  state a stage hands on (or, on the last, its ``trailing_top_*`` candidates) and the keys and
  values it appends;
- the next stage is fed the steps' hidden states, one a step, and the passes' as they came.

The verdict is the chain's: one difference anywhere and the model decodes a token a pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from protocols.decoder import (
    ATTENTION_MASK,
    POSITION_IDS,
    TOP_IDS,
    TOP_LOGITS,
    TRAILING_POSITIONS,
    TRAILING_TOP_IDS,
    TRAILING_TOP_LOGITS,
)

Arrays = dict[str, np.ndarray]
Run = Callable[[Mapping[str, np.ndarray]], Arrays]
"""Runs one segment on feeds by name (every input it declares) and returns all its outputs."""
PROBE_TOKENS = (230, 77, 5, 1000, 2000, 31, 8, 99)
"""Token ids fed after the prompt (taken modulo the vocabulary size)."""
AXIS = 2
"""The sequence axis of ``past.*`` / ``present.*`` (``[batch, kv_heads, sequence, head_dim]``)."""


def _present(past: str) -> str:
    return "present" + past.removeprefix("past")


@dataclass
class RowsProbe:
    """The probe of a chain, fed its stages in order (module docstring).

    ``prompt_length``: tokens of the prefill whose presents each :meth:`stage` call receives;
    ``vocab``: the model's vocabulary size (the probe's tokens are taken modulo it).
    """

    prompt_length: int
    vocab: int
    width: int = min(TRAILING_POSITIONS, len(PROBE_TOKENS))
    alike: bool = True
    difference: str | None = None
    """Where the first difference was found (stage, pass length, tensor); None while alike."""
    _entries: list[np.ndarray] = field(default_factory=list)
    _stage: int = 0

    def __post_init__(self) -> None:
        tokens = [t % self.vocab for t in PROBE_TOKENS[: self.width]]
        self._entries = [np.asarray([[t]], dtype=np.int64) for t in tokens]

    def stage(self, run: Run, inputs: Sequence[str], prefill: Mapping[str, np.ndarray]) -> bool:
        """Probe the next stage: ``run`` runs it, ``inputs`` are its input names, ``prefill``
        holds the prompt's prefill outputs (its presents). Returns the verdict so far; after a
        difference later stages are not run."""
        k, self._stage = self._stage, self._stage + 1
        if not self.alike:
            return False
        entry = next(n for n in inputs if n not in (ATTENTION_MASK, POSITION_IDS) and not
                     n.startswith("past."))  # fmt: skip
        pasts = [n for n in inputs if n.startswith("past.")]
        start = {p: prefill[_present(p)] for p in pasts}
        steps: list[Arrays] = []
        cache = dict(start)
        for j, value in enumerate(self._entries):
            out = run(self._feeds(inputs, entry, value, j, 1, cache))
            cache = {p: out[_present(p)] for p in pasts}
            steps.append(out)
        for count in range(2, self.width + 1):
            value = np.concatenate(self._entries[:count], axis=1)
            together = run(self._feeds(inputs, entry, value, 0, count, start))
            where = _difference(together, steps[:count], self.prompt_length)
            if where is not None:
                self.alike = False
                self.difference = f"stage {k}, a pass of {count} tokens: {where}"
                return False
        handed = [n for n in steps[0] if n.startswith("hidden.")]
        if handed:
            self._entries = [s[handed[0]] for s in steps]
        return True

    def _feeds(
        self,
        inputs: Sequence[str],
        entry: str,
        value: np.ndarray,
        offset: int,
        count: int,
        pasts: Mapping[str, np.ndarray],
    ) -> Arrays:
        position = self.prompt_length + offset
        feeds: Arrays = {
            entry: value,
            ATTENTION_MASK: np.ones((1, position + count), dtype=np.int64),
            POSITION_IDS: np.arange(position, position + count, dtype=np.int64).reshape(1, count),
            **pasts,
        }
        return {n: feeds[n] for n in inputs}


def _difference(together: Arrays, steps: Sequence[Arrays], prompt: int) -> str | None:
    """The first output of a pass (``together``) that differs from the one-token ``steps``;
    None when all are bit for bit alike."""
    for name, value in together.items():
        if name.startswith(("hidden.", "present.")):
            where = _positions_differ(name, value, steps, prompt)
        elif name in (TRAILING_TOP_LOGITS, TRAILING_TOP_IDS):
            where = _candidates_differ(name, value, steps)
        else:
            where = None
        if where is not None:
            return where
    return None


def _positions_differ(
    name: str, value: np.ndarray, steps: Sequence[Arrays], prompt: int
) -> str | None:
    """A hidden state (position ``c`` of the pass on axis 1) or a present (position ``prompt +
    c`` on :data:`AXIS`) against each step's."""
    for c, step in enumerate(steps):
        if name.startswith("hidden."):
            alike = np.array_equal(value[:, c : c + 1], step[name])
        else:
            got = np.take(value, [prompt + c], axis=AXIS)
            alike = np.array_equal(got, np.take(step[name], [prompt + c], axis=AXIS))
        if not alike:
            return f"{name} at position {c}"
    return None


def _candidates_differ(name: str, value: np.ndarray, steps: Sequence[Arrays]) -> str | None:
    """The last stage's trailing candidates (oldest first) against each step's ``top_*``."""
    single = TOP_LOGITS if name == TRAILING_TOP_LOGITS else TOP_IDS
    rows = value[0]
    for back in range(1, len(rows) + 1):
        if not np.array_equal(rows[-back], steps[len(steps) - back][single][0]):
            return f"{name} at position {len(steps) - back}"
    return None
