"""``/v1/embeddings``: tokenizer on the coordinator, the encoder on the chain, pooling here.

Pooling is what sentence-transformers does for all-MiniLM-L6-v2: the mean of the last hidden
states over the attention mask, then L2 normalisation. The tokenizer is read from a local
directory (``tokenizer.json``, with ``sentence_bert_config.json``'s ``max_seq_length`` when
present); nothing is downloaded.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.deployments import DeploymentStore, VersionRecord
from coordinator.errors import NotServableError, RequestError
from coordinator.microbatch import micro_batches
from coordinator.serving import Router

MAX_INPUTS = 256
MAX_CHARS = 100_000
DEFAULT_MAX_TOKENS = 256
SAME_VERSION_TRIES = 3
HIDDEN = "last_hidden_state"
POOLED = "sentence_embedding"


def default_tokenizer_dir(model_id: str) -> str | None:
    """The tokenizer shipped with a model we know by id (``all-minilm-l6-v2``), if installed."""
    if model_id != "all-minilm-l6-v2":
        return None
    from partitioner.errors import GraphError
    from partitioner.frontdoor import minilm_dir

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
        max_tokens = DEFAULT_MAX_TOKENS
        config = directory / "sentence_bert_config.json"
        if config.is_file():
            max_tokens = int(json.loads(config.read_text()).get("max_seq_length", max_tokens))
        self._tokenizer.enable_truncation(max_length=max_tokens)
        padding = self._tokenizer.padding or {}
        self._tokenizer.enable_padding(
            pad_id=int(padding.get("pad_id", 0)), pad_token=str(padding.get("pad_token", "[PAD]"))
        )

    def lengths(self, texts: Sequence[str]) -> list[int]:
        """Each text's token count after truncation (what padding makes the batch's width)."""
        return [sum(e.attention_mask) for e in self._tokenizer.encode_batch(list(texts))]

    def encode(self, texts: Sequence[str]) -> tuple[dict[str, np.ndarray[Any, Any]], int]:
        """BERT inputs for a batch, and the number of real (unpadded) tokens."""
        encodings = self._tokenizer.encode_batch(list(texts))
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        types = np.array([e.type_ids for e in encodings], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return feeds, int(mask.sum())


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
        self, model_id: str, texts: Sequence[str]
    ) -> tuple[VersionRecord, np.ndarray[Any, Any], int]:
        """The version used, one normalised vector per text, and the token count."""
        _check_texts(texts)
        record = self._store.model(model_id)
        if record.tokenizer_dir is None:
            raise RequestError(f"model {model_id!r} is not a text encoder (no tokenizer)")
        encoder = self._encoder(record.tokenizer_dir)
        parts = micro_batches(encoder.lengths(texts))
        for _ in range(SAME_VERSION_TRIES):
            runs = [self._run(model_id, encoder, texts[part]) for part in parts]
            versions = {run[0].plan_version for run in runs}
            if len(versions) == 1:
                vectors = np.concatenate([run[1] for run in runs])
                return runs[0][0], vectors, sum(run[2] for run in runs)
        raise NotServableError(f"model {model_id!r} changed version during every try")

    def _run(
        self, model_id: str, encoder: TextEncoder, texts: Sequence[str]
    ) -> tuple[VersionRecord, np.ndarray[Any, Any], int]:
        feeds, tokens = encoder.encode(texts)
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


def _check_texts(texts: Sequence[str]) -> None:
    if not texts:
        raise RequestError("input is empty")
    if len(texts) > MAX_INPUTS:
        raise RequestError(f"at most {MAX_INPUTS} inputs per request, got {len(texts)}")
    for i, text in enumerate(texts):
        if not text:
            raise RequestError(f"input {i} is an empty string")
        if len(text) > MAX_CHARS:
            raise RequestError(f"input {i} is longer than {MAX_CHARS} characters")
