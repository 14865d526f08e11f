"""Greedy generation with the whole decoder in one ONNX Runtime session.

:class:`OrtDecoder` keeps the key/value state between steps itself (numpy arrays), feeding
every ``present.*`` back as ``past.*``. It is the single-session baseline the sharded
pipeline is compared with.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from partitioner.errors import GraphError
from protocols.decoder import DECODER_METADATA_KEY, MODEL_FILE, TOP_IDS, TOP_LOGITS, DecoderInfo


@dataclass(frozen=True)
class StepResult:
    """Next-token candidates of the last position, best first."""

    top_logits: np.ndarray
    """float32 ``[top_k]``."""
    top_ids: np.ndarray
    """int64 ``[top_k]``."""

    @property
    def token(self) -> int:
        """The greedy choice."""
        return int(self.top_ids[0])


def read_info(model_path: Path) -> DecoderInfo:
    """The DecoderInfo embedded in an exported ``model.onnx``."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == DECODER_METADATA_KEY:
            return DecoderInfo.from_json(prop.value)
    raise GraphError(f"{model_path}: no {DECODER_METADATA_KEY} metadata (not a decoder export)")


class OrtDecoder:
    """One ONNX Runtime session over a whole exported decoder, with its own KV state."""

    def __init__(self, model: Path, *, threads: int | None = None) -> None:
        """``model``: an export directory or its ``model.onnx``; ``threads``: intra-op threads
        (ONNX Runtime's default when ``None``)."""
        import onnxruntime as ort

        path = model / MODEL_FILE if model.is_dir() else model
        self.info = read_info(path)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if threads is not None:
            options.intra_op_num_threads = threads
        self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self._outputs = [o.name for o in self._session.get_outputs()]
        self._past: list[np.ndarray] = []
        self.reset()

    @property
    def context_length(self) -> int:
        """Tokens held in the KV state."""
        return int(self._past[0].shape[2])

    @property
    def kv(self) -> dict[str, np.ndarray]:
        """The key/value state by ``past.*`` name: what the next step feeds."""
        return {pair.past: past for pair, past in zip(self.info.state, self._past, strict=True)}

    def reset(self) -> None:
        """Forget the context (empty KV state)."""
        shape = (1, self.info.num_kv_heads, 0, self.info.head_dim)
        self._past = [np.zeros(shape, dtype=np.float32) for _ in self.info.state]

    def prefill(self, prompt_ids: Sequence[int]) -> StepResult:
        """Start a new context with ``prompt_ids``; the candidates for the token after it."""
        self.reset()
        return self.step(prompt_ids)

    def decode(self, token: int) -> StepResult:
        """Append one token to the context; the candidates for the token after it."""
        return self.step([token])

    def step(self, ids: Sequence[int]) -> StepResult:
        """Append ``ids`` to the context and run them in one call."""
        values = self.run_step(ids)
        return StepResult(values[TOP_LOGITS][0], values[TOP_IDS][0])

    def run_step(self, ids: Sequence[int]) -> dict[str, np.ndarray]:
        """Like :meth:`step`, but every output of the graph by name."""
        if not ids:
            raise GraphError("a step needs at least one token")
        seen = self.context_length
        total = seen + len(ids)
        if total > self.info.max_context:
            raise GraphError(f"context of {total} tokens exceeds {self.info.max_context}")
        feeds = {
            "input_ids": np.asarray([list(ids)], dtype=np.int64),
            "attention_mask": np.ones((1, total), dtype=np.int64),
            "position_ids": np.arange(seen, total, dtype=np.int64)[None, :],
        }
        feeds.update(self.kv)
        values = dict(zip(self._outputs, self._session.run(self._outputs, feeds), strict=True))
        self._past = [values[pair.present] for pair in self.info.state]
        return values

    def greedy(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        stop_ids: Iterable[int] | None = None,
    ) -> list[int]:
        """Greedy continuation of ``prompt_ids``: at most ``max_new_tokens`` new tokens, ending
        early after a token in ``stop_ids`` (default: the model's end-of-sequence tokens;
        pass ``()`` to always generate ``max_new_tokens``)."""
        stops = set(self.info.eos_token_ids if stop_ids is None else stop_ids)
        generated: list[int] = []
        if max_new_tokens < 1:
            return generated
        result = self.prefill(prompt_ids)
        while True:
            generated.append(result.token)
            if len(generated) >= max_new_tokens or result.token in stops:
                return generated
            result = self.decode(result.token)
