"""Fakes for the generation tests: a byte-level tokenizer built in code and a bigram backend.

The backend is a deterministic "model": a ``[V, V]`` logit table indexed by the last token, so
every expected output can be computed from the table. Scripted chains (``a -> b`` with a huge
logit) make greedy outputs readable text.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from coordinator.generation.backend import GenerationModel, TopCandidates
from coordinator.generation.tokenizer import ChatTokenizer
from protocols.decoder import DecoderInfo, StatePair

WORDS = [" the", " cat", " sat", " on", " mat", " dog", " ran", " a", " big", " red", " it"]
SPECIALS = ["<bos>", "<eos>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-printable-character map (what the ByteLevel decoder inverts)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def byte_tokenizer() -> Any:
    """A byte-level BPE tokenizer: id b is byte b, then ``WORDS``, then ``<bos>``, ``<eos>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    for word in WORDS:
        vocab["".join(table[b] for b in word.encode())] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def word_id(word: str) -> int:
    """Token id of one of ``WORDS``."""
    return 256 + WORDS.index(word)


BOS = 256 + len(WORDS)
EOS = BOS + 1
VOCAB = EOS + 1


def decoder_info(
    max_context: int = 256, top_k: int = 8, chat_template: str | None = CHAT_TEMPLATE
) -> DecoderInfo:
    """A DecoderInfo for the byte tokenizer."""
    return DecoderInfo(
        model="tiny",
        architecture="Bigram",
        num_layers=1,
        hidden_size=8,
        num_kv_heads=1,
        head_dim=8,
        vocab_size=VOCAB,
        top_k=top_k,
        max_context=max_context,
        bos_token_id=BOS,
        eos_token_ids=[EOS],
        chat_template=chat_template,
        state=[StatePair(past="past.0.key", present="present.0.key")],
        rows_probed=True,  # the fakes compute each position alone
    )


def bigram_table(seed: int = 0, chain: Sequence[str] = ()) -> NDArray[np.float32]:
    """Random logits over the word tokens (bytes and specials unlikely); ``chain`` scripted.

    ``chain`` is a list of words: each word's row strongly prefers the next word, and every
    non-word token (so the end of any prompt) prefers the first word.
    """
    rng = np.random.default_rng(seed)
    table = np.full((VOCAB, VOCAB), -30.0, dtype=np.float32)
    words = [word_id(w) for w in WORDS]
    table[:, words] = rng.normal(scale=2.0, size=(VOCAB, len(words))).astype(np.float32)
    if chain:
        ids = [word_id(w) for w in chain]
        for row in range(VOCAB):
            if row not in ids:
                table[row, ids[0]] = 100.0
        for a, b in itertools.pairwise(ids):
            table[a, b] = 100.0
    return table


class BigramBackend:
    """A fake DecoderBackend: candidates are the top-k of the last token's table row.

    It records every call, checks positions, counts overlapping steps, and can be told to
    refuse new sessions (``capacity``) or to fail at a given step (``fail_at``).
    """

    def __init__(
        self,
        table: NDArray[np.float32],
        top_k: int = 8,
        delay_s: float = 0.0,
        capacity: float | None = None,
        fail_at: int | None = None,
        fail_with: Exception | None = None,
    ) -> None:
        self.table = table
        self.top_k = top_k
        self.delay_s = delay_s
        self.capacity = capacity
        self.fail_at = fail_at
        self.fail_with = fail_with
        self.steps: list[tuple[str, int, list[int]]] = []
        self.ended: list[str] = []
        self.lengths: dict[str, int] = {}
        self.active = 0
        self.max_active = 0

    def candidates(self, last: int) -> TopCandidates:
        """The top-k of ``table[last]``, descending (what a real graph returns)."""
        row = self.table[last]
        order = np.argsort(-row, kind="stable")[: self.top_k]
        return TopCandidates.of(row[order], order)

    async def step(self, session: str, position: int, token_ids: Sequence[int]) -> TopCandidates:
        """Record the step, check the position, answer from the table."""
        from coordinator.errors import AgentError, CapacityError

        self.steps.append((session, position, list(token_ids)))
        if position == 0 and self.capacity is not None:
            raise CapacityError("no room for a new session", retry_after_s=self.capacity)
        if self.lengths.get(session, 0) != position:
            raise AssertionError(f"{session}: position {position}, held {self.lengths}")
        self.lengths[session] = position + len(token_ids)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.active -= 1
        if self.fail_at is not None and len(self.steps_of(session)) >= self.fail_at:
            raise self.fail_with or AgentError("stage 2 went away")
        return self.candidates(int(token_ids[-1]))

    async def end(self, session: str) -> None:
        """Record the end of ``session`` (after an await, as a real release has)."""
        await asyncio.sleep(0)
        self.ended.append(session)
        self.lengths.pop(session, None)

    def steps_of(self, session: str) -> list[tuple[str, int, list[int]]]:
        """The steps of one session."""
        return [s for s in self.steps if s[0] == session]

    def greedy(self, prompt: Sequence[int], count: int) -> list[int]:
        """What greedy decoding of ``count`` tokens must produce (reference)."""
        out, last = [], int(prompt[-1])
        for _ in range(count):
            last = int(self.candidates(last).ids[0])
            out.append(last)
        return out


def tiny_model(backend: BigramBackend, **info: Any) -> GenerationModel:
    """The fake backend with the byte tokenizer and its DecoderInfo."""
    decoder = decoder_info(top_k=backend.top_k, **info)
    return GenerationModel(backend, ChatTokenizer(byte_tokenizer(), decoder), decoder)
