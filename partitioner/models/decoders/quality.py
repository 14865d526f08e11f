"""What a weight precision costs: next-token agreement with float32 and perplexity on real text.

The text is the "Execution model" chapter of the Python language reference as the standard
library ships it (:mod:`pydoc_data.topics`): real English prose, installed everywhere, never
downloaded. Both decoders read the same tokens one at a time (teacher forcing, KV cache kept
between steps); at every position each predicts the next token from its full logits, which a
temporary copy of the graph exposes next to ``top_logits`` (the input of its ``TopK``).

- **top-1 agreement**: the share of positions where the candidate's most likely next token is
  the reference's;
- **perplexity**: ``exp`` of the mean negative log-likelihood of the text's actual next token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from partitioner.errors import GraphError
from partitioner.models.decoders.ort_runner import OrtDecoder
from partitioner.models.packaged import offline
from protocols.decoder import MODEL_FILE, TOP_LOGITS

if TYPE_CHECKING:
    from partitioner.models.decoders.precision import Report

QUALITY_TOKENS = 128
"""Positions of the text each precision is scored on."""
TEXT_TOPIC = "execmodel"
"""The :mod:`pydoc_data.topics` entry the score is taken on."""
LOGITS_OUTPUT = "fedshard.quality.logits"
_SCRATCH = ".quality-model.onnx"


@dataclass(frozen=True)
class Quality:
    """One decoder scored against a reference on the same tokens."""

    tokens: int
    """Positions scored."""
    top1_agreement: float
    """Share of positions where both pick the same most likely next token (1.0 = always)."""
    perplexity: float
    reference_perplexity: float


class PrecisionSummary(BaseModel):
    """``precision.json`` next to a converted decoder: what its precision saves and costs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["fedshard.precision/1"] = "fedshard.precision/1"
    weights: str
    source_bytes: int
    weight_bytes: int
    operators: dict[str, int]
    text: str
    """Where the scored text comes from."""
    tokens: int
    top1_agreement: float
    perplexity: float
    reference_perplexity: float


SUMMARY_FILE = "precision.json"


def write_summary(out_dir: Path, report: Report, quality: Quality) -> PrecisionSummary:
    """Write ``out_dir/precision.json`` for ``report`` and ``quality``."""
    summary = PrecisionSummary(
        weights=report.weights,
        source_bytes=report.source_bytes,
        weight_bytes=report.weight_bytes,
        operators=report.operators,
        text=f"pydoc_data.topics[{TEXT_TOPIC!r}]",
        tokens=quality.tokens,
        top1_agreement=quality.top1_agreement,
        perplexity=quality.perplexity,
        reference_perplexity=quality.reference_perplexity,
    )
    (out_dir / SUMMARY_FILE).write_text(summary.model_dump_json(indent=2) + "\n")
    return summary


def evaluation_text() -> str:
    """The fixed real text precisions are scored on."""
    from pydoc_data.topics import topics

    text = topics.get(TEXT_TOPIC)
    if not isinstance(text, str) or not text:
        raise GraphError(f"pydoc_data.topics has no {TEXT_TOPIC!r} entry")
    return text


def evaluation_ids(export_dir: Path, tokens: int = QUALITY_TOKENS) -> list[int]:
    """``tokens + 1`` token ids of :func:`evaluation_text` with ``export_dir``'s tokenizer."""
    from transformers import AutoTokenizer

    offline()
    tokenizer = AutoTokenizer.from_pretrained(str(export_dir))
    ids = [int(i) for i in tokenizer(evaluation_text(), verbose=False)["input_ids"]]
    if len(ids) < tokens + 1:
        raise GraphError(f"the evaluation text gives {len(ids)} tokens, need {tokens + 1}")
    return ids[: tokens + 1]


def compare_decoders(reference: Path, candidate: Path, tokens: int = QUALITY_TOKENS) -> Quality:
    """Score the decoder export ``candidate`` against ``reference`` (both directories)."""
    ids = evaluation_ids(candidate, tokens)
    want = position_logits(reference, ids[:-1])
    got = position_logits(candidate, ids[:-1])
    return Quality(
        tokens=len(ids) - 1,
        top1_agreement=float(np.mean(want.argmax(axis=1) == got.argmax(axis=1))),
        perplexity=perplexity(got, ids[1:]),
        reference_perplexity=perplexity(want, ids[1:]),
    )


def perplexity(logits: np.ndarray, targets: Sequence[int]) -> float:
    """``exp`` of the mean negative log-softmax of ``targets`` under ``logits[position]``."""
    x = logits.astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(x - top).sum(axis=1)) + top[:, 0]
    picked = x[np.arange(len(targets)), np.asarray(targets)]
    return math.exp(float(np.mean(log_z - picked)))


def position_logits(export_dir: Path, ids: Sequence[int]) -> np.ndarray:
    """Full next-token logits ``[len(ids), vocab]`` after each prefix of ``ids``."""
    scratch = export_dir / _SCRATCH
    _write_logits_model(export_dir / MODEL_FILE, scratch)
    try:
        decoder = OrtDecoder(scratch, threads=1)
        rows = [decoder.run_step([token])[LOGITS_OUTPUT].reshape(-1) for token in ids]
    finally:
        scratch.unlink(missing_ok=True)
    return np.stack(rows).astype(np.float32)


def _write_logits_model(model_path: Path, out: Path) -> None:
    """A copy of the graph (weights referenced, not copied) that also outputs the full logits
    of the last position: the input of the ``TopK`` behind ``top_logits``."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    producer = {o: n for n in model.graph.node for o in n.output}
    node = producer.get(TOP_LOGITS)
    while node is not None and node.op_type != "TopK":
        node = producer.get(node.input[0])
    if node is None:
        raise GraphError(f"{model_path}: no TopK behind {TOP_LOGITS}")
    model.graph.node.append(onnx.helper.make_node("Identity", [node.input[0]], [LOGITS_OUTPUT]))
    model.graph.output.append(onnx.helper.make_empty_tensor_value_info(LOGITS_OUTPUT))
    onnx.save(model, str(out))
