"""``/v1/embeddings``: tokenizer on the coordinator, the encoder on the chain, pooling here.

Pooling is what sentence-transformers does for all-MiniLM-L6-v2: the mean of the last hidden
states over the attention mask, then L2 normalisation. The tokenizer is read from a local
directory (``tokenizer.json``, with ``sentence_bert_config.json``'s ``max_seq_length`` when
present); nothing is downloaded.

An input is a text, or token ids of the model's own tokenizer used as given (what its
``encode`` returns, special tokens included: ``[CLS] ... [SEP]`` for MiniLM), so ids and their
text embed to the same vector. Text is truncated to the model's ``max_seq_length`` as
sentence-transformers does; ids longer than that, or outside the vocabulary, are refused.

``dimensions`` is honoured where the model allows it: shortening a vector (and normalising it
again) keeps its meaning only for a model trained for it (Matryoshka representation learning),
and all-MiniLM-L6-v2 was not, so every model accepts exactly its native size (384 for MiniLM),
and any other value is refused with the size it has.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.deploy.limits import MICRO_BATCH_TOKENS, tokenizer_max_tokens
from coordinator.deploy.store import DeploymentStore, VersionRecord
from coordinator.errors import DimensionsError, NotServableError, RequestError, ShapeLimitError
from coordinator.serving.microbatch import micro_batches
from coordinator.serving.router import Router
from protocols.deploy import ShapeLimits

MAX_INPUTS = 256
Input = str | Sequence[int]
"""One input: a text, or token ids of the model's tokenizer."""
MAX_CHARS = 100_000
SAME_VERSION_TRIES = 3
HIDDEN = "last_hidden_state"
POOLED = "sentence_embedding"


def default_tokenizer_dir(model_id: str) -> str | None:
    """The tokenizer shipped with a model we know by id (``all-minilm-l6-v2``), if installed."""
    if model_id != "all-minilm-l6-v2":
        return None
    from partitioner.errors import GraphError
    from partitioner.models.packaged import minilm_dir

    try:
        return str(minilm_dir())
    except GraphError:
        return None


class TextEncoder:
    """A ``tokenizers`` tokenizer that pads a batch to its longest text."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer

        path = directory / "tokenizer.json"
        if not path.is_file():
            raise NotServableError(f"no tokenizer at {path}")
        self._tokenizer = Tokenizer.from_file(str(path))
        max_tokens = tokenizer_max_tokens(directory)
        self._tokenizer.enable_truncation(max_length=max_tokens)
        padding = self._tokenizer.padding or {}
        self._tokenizer.enable_padding(
            pad_id=int(padding.get("pad_id", 0)), pad_token=str(padding.get("pad_token", "[PAD]"))
        )

        self._max_tokens = max_tokens
        self._pad_id = int(padding.get("pad_id", 0))

    @property
    def max_tokens(self) -> int:
        """The longest input this tokenizer keeps (texts are truncated to it)."""
        return self._max_tokens

    def encode(self, texts: Sequence[str]) -> tuple[dict[str, np.ndarray[Any, Any]], int]:
        """BERT inputs for a batch, and the number of real (unpadded) tokens."""
        encodings = self._tokenizer.encode_batch(list(texts))
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        types = np.array([e.type_ids for e in encodings], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return feeds, int(mask.sum())

    def encode_ids(
        self, batch: Sequence[Sequence[int]]
    ) -> tuple[dict[str, np.ndarray[Any, Any]], int]:
        """BERT inputs for token ids used as given (padded to the longest), and their count."""
        vocab = self._tokenizer.get_vocab_size(with_added_tokens=True)
        for i, ids in enumerate(batch):
            if len(ids) > self._max_tokens:
                raise RequestError(
                    f"input {i} has {len(ids)} tokens; this model reads at most {self._max_tokens}"
                )
            if any(not 0 <= t < vocab for t in ids):
                raise RequestError(f"input {i}: token ids must be in [0, {vocab})")
        width = max(len(ids) for ids in batch)
        padded = np.full((len(batch), width), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        for row, ids in enumerate(batch):
            padded[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1
        types = np.zeros_like(padded)
        feeds = {"input_ids": padded, "attention_mask": mask, "token_type_ids": types}
        return feeds, int(mask.sum())

    def lengths(self, inputs: Sequence[Input]) -> list[int]:
        """Each input's token count after truncation (what padding makes the batch's width)."""
        if all(isinstance(x, str) for x in inputs):
            encodings = self._tokenizer.encode_batch([str(x) for x in inputs])
            return [sum(e.attention_mask) for e in encodings]
        return [len(x) for x in inputs]

    def encode_inputs(self, inputs: Sequence[Input]) -> tuple[dict[str, np.ndarray[Any, Any]], int]:
        """Feeds for texts, or for token ids (one kind per request)."""
        if all(isinstance(x, str) for x in inputs):
            return self.encode([str(x) for x in inputs])
        if any(isinstance(x, str) for x in inputs):
            raise RequestError("input mixes texts and token ids")
        return self.encode_ids([[int(t) for t in x] for x in inputs])


def mean_pool(hidden: np.ndarray[Any, Any], mask: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Mean over the unmasked tokens, L2-normalised (sentence-transformers' MiniLM pooling)."""
    weights = mask[..., None].astype(np.float32)
    summed = (hidden.astype(np.float32) * weights).sum(axis=1)
    pooled = summed / np.clip(weights.sum(axis=1), 1e-9, None)
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    normalised: np.ndarray[Any, Any] = pooled / np.clip(norms, 1e-12, None)
    return normalised


class Embedder:
    """Embeddings for text-encoder deployments."""

    def __init__(self, store: DeploymentStore, router: Router) -> None:
        self._store = store
        self._router = router
        self._encoders: dict[str, TextEncoder] = {}
        self._lock = threading.Lock()

    def embed(
        self, model_id: str, inputs: Sequence[Input], dimensions: int | None = None
    ) -> tuple[VersionRecord, np.ndarray[Any, Any], int]:
        """The version used, one normalised vector per input, and the token count.

        ``dimensions``, when given, must be the model's native size (see the module's notes).
        """
        record = self._store.model(model_id)
        _check_inputs(inputs)
        if record.tokenizer_dir is None:
            raise RequestError(f"model {model_id!r} is not a text encoder (no tokenizer)")
        encoder = self._encoder(record.tokenizer_dir)
        limits = self._store.active(model_id).limits
        lengths = encoder.lengths(inputs)
        _check_planned(lengths, limits)
        budget = limits.product if limits is not None and limits.product else MICRO_BATCH_TOKENS
        parts = micro_batches(lengths, budget)
        for _ in range(SAME_VERSION_TRIES):
            runs = [self._run(model_id, encoder, inputs[part]) for part in parts]
            if len({run[0].plan_version for run in runs}) == 1:
                vectors = np.concatenate([run[1] for run in runs])
                check_dimensions(model_id, int(vectors.shape[-1]), dimensions)
                return runs[0][0], vectors, sum(run[2] for run in runs)
        raise NotServableError(f"model {model_id!r} changed version during every try")

    def _run(
        self, model_id: str, encoder: TextEncoder, inputs: Sequence[Input]
    ) -> tuple[VersionRecord, np.ndarray[Any, Any], int]:
        """One micro-batch through the chain: the version used, its vectors, its tokens."""
        feeds, tokens = encoder.encode_inputs(inputs)
        version, outputs = self._router.infer(model_id, feeds)
        if HIDDEN in outputs:
            return version, mean_pool(outputs[HIDDEN], feeds["attention_mask"]), tokens
        if POOLED in outputs:
            return version, outputs[POOLED].astype(np.float32), tokens
        raise RequestError(f"model {model_id!r} has neither {HIDDEN!r} nor {POOLED!r} outputs")

    def _encoder(self, directory: str) -> TextEncoder:
        with self._lock:
            encoder = self._encoders.get(directory)
            if encoder is None:
                encoder = self._encoders[directory] = TextEncoder(Path(directory))
            return encoder


def check_dimensions(model_id: str, native: int, requested: int | None) -> None:
    """Refuse a ``dimensions`` other than the model's native size (no Matryoshka training)."""
    if requested is not None and requested != native:
        raise DimensionsError(
            f"model {model_id!r} makes {native}-dimensional embeddings and was not trained to "
            f"be shortened (Matryoshka), so dimensions must be {native} or left out, "
            f"not {requested}"
        )


def _check_planned(lengths: Sequence[int], limits: ShapeLimits | None) -> None:
    """Refuse an input longer than the deployment was planned for (its devices' memory)."""
    longest = None if limits is None else limits.dims.get("sequence")
    for i, length in enumerate(lengths):
        if longest is not None and length > longest:
            raise ShapeLimitError(
                f"input {i} has {length} tokens; this deployment was planned for inputs of at "
                f"most {longest} tokens (what its devices' memory holds)"
            )


def _check_inputs(inputs: Sequence[Input]) -> None:
    if not inputs:
        raise RequestError("input is empty")
    if len(inputs) > MAX_INPUTS:
        raise RequestError(f"at most {MAX_INPUTS} inputs per request, got {len(inputs)}")
    for i, item in enumerate(inputs):
        if not item:
            kind = "string" if isinstance(item, str) else "list of token ids"
            raise RequestError(f"input {i} is an empty {kind}")
        if isinstance(item, str) and len(item) > MAX_CHARS:
            raise RequestError(f"input {i} is longer than {MAX_CHARS} characters")
