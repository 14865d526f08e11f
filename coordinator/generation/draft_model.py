"""The draft-model drafter: a small decoder with the served model's tokenizer, run whole on the
coordinator in one ONNX Runtime session (an export directory of ``fedshard export``).

One :class:`DraftModel` (one ONNX Runtime session, its weights loaded once) serves every
generation of the model it drafts for; each generation drafts through its own
:class:`DraftStream`, which keeps the draft model's KV cache for that generation's text. The
cache follows the text: it reads the prompt while the chain does (:meth:`DraftStream.prepare`);
when asked for a draft, a stream keeps the longest prefix of the text its cache already holds
(the rejected drafts of the last pass fall off, a *rollback*), feeds the rest in one call, then
drafts greedily one token per call while the draft model is sure of them: after a token whose
probability is below ``min_confidence`` it stops (that token is still proposed; llama.cpp's
``p_min`` does the same), so the chain does not verify, and the drafter does not spend calls
on, guesses that are likely wrong. The drafts are greedy, so the
speculative-sampling rule in :mod:`coordinator.generation.speculative` (a point-mass draft
distribution) keeps the target's distribution exactly.

:func:`check_draft_model` refuses a draft whose tokenizer differs from the served model's
(the same text must map to the same ids, or every draft is noise): :class:`DraftModelError`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.errors import DraftModelError
from protocols.decoder import DECODER_FILE, MODEL_FILE, TOP_IDS, TOP_LOGITS, DecoderInfo

DRAFT_THREADS = 1
"""ONNX Runtime intra-op threads per draft call unless told (``fedshard coordinator
--draft-threads``: a stream's chain waits while its draft runs, so the coordinator's cores are
otherwise idle then)."""
MIN_CONFIDENCE = 0.75
"""A draft stops after a token the draft model gives less than this probability (llama.cpp's
``common_speculative_params.p_min`` default)."""
TOKENIZER_FILE = "tokenizer.json"


def _vocab(directory: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    file = directory / TOKENIZER_FILE
    if not file.is_file():
        raise DraftModelError(f"no {TOKENIZER_FILE} in {directory}")
    try:
        vocab: dict[str, int] = Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
    except Exception as exc:  # the Rust loader raises a bare Exception
        raise DraftModelError(f"cannot load the tokenizer {file}: {exc}") from exc
    return vocab


def check_draft_model(draft_dir: Path, tokenizer_dir: Path) -> DecoderInfo:
    """The draft's DecoderInfo, once ``draft_dir`` is a decoder export whose tokenizer maps
    every token to the same id as the served model's (``tokenizer_dir``); else
    :class:`DraftModelError` naming the difference."""
    info_file, model_file = draft_dir / DECODER_FILE, draft_dir / MODEL_FILE
    if not (info_file.is_file() and model_file.is_file()):
        raise DraftModelError(
            f"{draft_dir} is not a decoder export (it needs {DECODER_FILE} and {MODEL_FILE}; "
            "make one with fedshard export)"
        )
    info = DecoderInfo.from_json(info_file.read_bytes())
    draft, served = _vocab(draft_dir), _vocab(tokenizer_dir)
    if draft != served:
        differ = sorted(t for t in draft.keys() | served.keys() if draft.get(t) != served.get(t))
        raise DraftModelError(
            f"the draft model {draft_dir} has another tokenizer than the served model "
            f"({len(draft)} vs {len(served)} tokens, {len(differ)} differ, e.g. "
            f"{', '.join(repr(t) for t in differ[:3])})"
        )
    return info


class DraftModel:
    """A draft decoder loaded for drafting (see the module docstring)."""

    def __init__(self, directory: Path, tokenizer_dir: Path, threads: int = DRAFT_THREADS) -> None:
        """Load the export in ``directory`` after :func:`check_draft_model` against the served
        model's ``tokenizer_dir``."""
        import onnxruntime as ort

        self.directory = directory
        self.info = check_draft_model(directory, tokenizer_dir)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # ONNX Runtime's workers spin for tens of milliseconds after a run by default: on a
        # machine that also runs stages they would take a core from the pass verifying the draft
        options.add_session_config_entry("session.force_spinning_stop", "1")
        self._session = ort.InferenceSession(
            str(directory / MODEL_FILE), options, providers=["CPUExecutionProvider"]
        )
        self._outputs = [TOP_LOGITS, TOP_IDS, *(pair.present for pair in self.info.state)]

    def stream(self, min_confidence: float = MIN_CONFIDENCE) -> DraftStream:
        """A drafter for one generation, with an empty cache."""
        return DraftStream(self, min_confidence)

    def empty(self) -> list[np.ndarray]:
        """An empty KV cache."""
        shape = (1, self.info.num_kv_heads, 0, self.info.head_dim)
        return [np.zeros(shape, dtype=np.float32) for _ in self.info.state]

    def run(
        self, ids: Sequence[int], past: list[np.ndarray]
    ) -> tuple[int, float, list[np.ndarray]]:
        """Feed ``ids`` after the ``past`` cache: the greedy next token, its probability and the
        grown cache. The probability is the softmax over the graph's top-k logits (the rest of
        the vocabulary left out, so it is at least the full softmax's)."""
        seen = int(past[0].shape[2])
        total = seen + len(ids)
        feeds: dict[str, Any] = {
            "input_ids": np.asarray([list(ids)], dtype=np.int64),
            "attention_mask": np.ones((1, total), dtype=np.int64),
            "position_ids": np.arange(seen, total, dtype=np.int64)[None, :],
        }
        feeds.update({pair.past: kv for pair, kv in zip(self.info.state, past, strict=True)})
        logits, top, *present = self._session.run(self._outputs, feeds)
        return int(np.asarray(top).reshape(-1)[0]), top_probability(logits), list(present)


def top_probability(logits: np.ndarray) -> float:
    """The softmax probability of the largest of ``logits`` (a top-k row, best first)."""
    row = np.asarray(logits, dtype=np.float64).reshape(-1)
    return float(1.0 / np.exp(row - row.max()).sum())


class DraftStream:
    """One generation's drafts from a :class:`DraftModel`, with that generation's cache."""

    blocking = True

    def __init__(self, model: DraftModel, min_confidence: float = MIN_CONFIDENCE) -> None:
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        self._model = model
        self._min_confidence = min_confidence
        self._tokens: list[int] = []
        """The tokens the cache holds, in order."""
        self._past = model.empty()
        self._lock = threading.Lock()

    @property
    def held(self) -> list[int]:
        """The tokens the draft cache holds."""
        return list(self._tokens)

    def propose(self, tokens: Sequence[int], count: int) -> list[int]:
        """Up to ``count`` greedy draft tokens after ``tokens`` (none past the draft's context),
        ending early after the first token the draft model is unsure of (the module docstring)."""
        if count < 1 or not tokens or len(tokens) + count > self._model.info.max_context:
            return []
        with self._lock:
            self.rollback(min(_common_prefix(self._tokens, tokens), len(tokens) - 1))
            token, confidence = self._feed(tokens[len(self._tokens) :])
            drafts = [token]
            while len(drafts) < count and confidence >= self._min_confidence:
                token, confidence = self._feed([token])
                drafts.append(token)
            return drafts

    def prepare(self, tokens: Sequence[int]) -> None:
        """Read ``tokens`` into the cache now (the prompt, while the chain reads it too)."""
        if not tokens or len(tokens) > self._model.info.max_context:
            return
        with self._lock:
            self.rollback(_common_prefix(self._tokens, tokens))
            if len(self._tokens) < len(tokens):
                self._feed(tokens[len(self._tokens) :])

    def rollback(self, length: int) -> None:
        """Cut the cache back to its first ``length`` tokens."""
        if not 0 <= length <= len(self._tokens):
            raise ValueError(f"the draft cache holds {len(self._tokens)} tokens, not {length}")
        del self._tokens[length:]
        self._past = [kv[:, :, :length, :] for kv in self._past]

    def _feed(self, ids: Sequence[int]) -> tuple[int, float]:
        token, confidence, self._past = self._model.run(ids, self._past)
        self._tokens.extend(ids)
        return token, confidence


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    size = min(len(a), len(b))
    for i in range(size):
        if a[i] != b[i]:
            return i
    return size
