"""Whether a chain of GGUF segments decodes a pass of ``k`` tokens as ``k`` one-token steps.

Speculative decoding verifies ``k`` drafted tokens in one pass of every stage; its greedy text is
the text of plain decoding only where that pass gives each position's candidates, and every
position's keys and values, bit for bit as one-token steps do. The builder makes its segments so
that it can (no float product on one row, attention scores whose kernel blocking does not follow
the context length: :func:`partitioner.models.gguf.archs._attend`); ``MatMulNBits`` does on the
CPUs whose kernel computes a lone row as it computes several. :class:`RowsProbe` checks it on
the segments as built, one stage at a time (so a caller holding one segment at a time, as the
deploy does, probes the whole chain), in windows: one right after the prompt's prefill (whose
presents the caller has), and one a few tokens short of each context length of :data:`REACH`
(a fill read in one pass after the prompt brings it there). In each window:

- :data:`PROBE_TOKENS` are fed one a step, each step's presents becoming the next step's pasts;
- then passes of every length ``m`` from 2 to :data:`~protocols.decoder.TRAILING_POSITIONS`
  from the window's start, each held bit for bit against the first ``m`` steps: the hidden
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
REACH = (64, 128)
"""Context lengths the probe's further windows cross: MLAS's SGEMM picks its blocking from
its operands' sizes at powers of two (see :func:`partitioner.models.gguf.archs._attend`)."""
FILL_STEP = 7919
"""Token ids of a window's fill: ``(FILL_STEP * i + 1) mod vocab`` (any text would do)."""
AXIS = 2
"""The sequence axis of ``past.*`` / ``present.*`` (``[batch, kv_heads, sequence, head_dim]``)."""


def _present(past: str) -> str:
    return "present" + past.removeprefix("past")


@dataclass
class _Window:
    """One stretch of the probe: ``fill`` (None: none) read in one pass after the prompt, then
    the steps and passes; each holds this stage's inputs (token ids on the first stage, the
    previous stage's hidden states after it)."""

    fill: np.ndarray | None
    entries: list[np.ndarray]


@dataclass
class RowsProbe:
    """The probe of a chain, fed its stages in order (module docstring).

    ``prompt_length``: tokens of the prefill whose presents each :meth:`stage` call receives;
    ``vocab``: the model's vocabulary size (the probe's tokens are taken modulo it);
    ``reach``: context lengths that further windows' steps cross (a fill after the prompt
    brings the context to a few tokens short of each), where a kernel's blocking could change
    with the number of keys; ``max_context``: windows that would not fit are left out.
    """

    prompt_length: int
    vocab: int
    width: int = min(TRAILING_POSITIONS, len(PROBE_TOKENS))
    reach: tuple[int, ...] = REACH
    max_context: int | None = None
    alike: bool = True
    difference: str | None = None
    """Where the first difference was found (stage, pass length, tensor); None while alike."""
    _windows: list[_Window] = field(default_factory=list)
    _stage: int = 0

    def __post_init__(self) -> None:
        tokens = [t % self.vocab for t in PROBE_TOKENS[: self.width]]
        entries = [np.asarray([[t]], dtype=np.int64) for t in tokens]
        self._windows = [_Window(None, entries)]
        limit = self.max_context if self.max_context is not None else 1 << 62
        for length in self.reach:
            fill = length - self.width // 2 - self.prompt_length
            if fill > 0 and length + self.width <= limit:
                ids = [(FILL_STEP * i + 1) % self.vocab for i in range(fill)]
                self._windows.append(_Window(np.asarray([ids], dtype=np.int64), entries))

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
        for window in self._windows:
            where = self._window(run, inputs, entry, pasts, start, window)
            if where is not None:
                self.alike = False
                self.difference = f"stage {k}, {where}"
                return False
        return True

    def _window(
        self,
        run: Run,
        inputs: Sequence[str],
        entry: str,
        pasts: list[str],
        start: Mapping[str, np.ndarray],
        window: _Window,
    ) -> str | None:
        """Run one window on this stage and hand its inputs on to the next; where the first
        difference was, else None."""
        base = self.prompt_length
        if window.fill is not None:
            filled = run(self._feeds(inputs, entry, window.fill, base, start))
            start = {p: filled[_present(p)] for p in pasts}
            base += window.fill.shape[1]
            window.fill = _handed(filled, window.fill)
        steps: list[Arrays] = []
        cache = dict(start)
        for j, value in enumerate(window.entries):
            out = run(self._feeds(inputs, entry, value, base + j, cache))
            cache = {p: out[_present(p)] for p in pasts}
            steps.append(out)
        for count in range(2, self.width + 1):
            value = np.concatenate(window.entries[:count], axis=1)
            together = run(self._feeds(inputs, entry, value, base, start))
            where = _difference(together, steps[:count], base)
            if where is not None:
                return f"{base} tokens then a pass of {count}: {where}"
        window.entries = [_handed(s, e) for s, e in zip(steps, window.entries, strict=True)]
        return None

    @staticmethod
    def _feeds(
        inputs: Sequence[str],
        entry: str,
        value: np.ndarray,
        position: int,
        pasts: Mapping[str, np.ndarray],
    ) -> Arrays:
        count = value.shape[1]
        feeds: Arrays = {
            entry: value,
            ATTENTION_MASK: np.ones((1, position + count), dtype=np.int64),
            POSITION_IDS: np.arange(position, position + count, dtype=np.int64).reshape(1, count),
            **pasts,
        }
        return {n: feeds[n] for n in inputs}


def _handed(out: Arrays, fed: np.ndarray) -> np.ndarray:
    """What the next stage is fed in place of ``fed``: this stage's hidden state (the last
    stage hands nothing on, so ``fed`` is kept)."""
    handed = [n for n in out if n.startswith("hidden.")]
    return out[handed[0]] if handed else fed


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
