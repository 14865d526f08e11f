"""The trainable tail of an encoder (BERT, e.g. all-MiniLM-L6-v2) and its contrastive objective.

:func:`build_encoder_tail` builds transformers' own ``BertLayer`` modules for layers
``first_layer ..`` on the ``meta`` device; :mod:`.model` assigns their weights from the
segments' initializers and injects the PEFT adapters, as for decoders. The tail maps the
residual stream at the plan's boundary and the attention mask to the last hidden state; the
sentence embedding is the served model's: the mean over real tokens, L2-normalised.

The objective is sentence-transformers' MultipleNegativesRankingLoss: in a batch of
``(anchor, positive)`` pairs, anchor ``i`` should score its own positive above every other
positive of the batch (cross-entropy over ``scale · cos``). Held-out pairs are scored the same
way over the whole held-out set: recall@1 is the share of anchors whose best positive is theirs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ENCODERS = {"BertModel": "bert"}
"""transformers encoder classes that can train (class -> module under ``transformers.models``)."""
EVAL_BATCH = 64


def encoder_local_name(name: str, first_layer: int) -> str | None:
    """``encoder.layer.5.attention.self.query.weight`` -> ``layers.<5 - first>...`` (or None)."""
    parts = name.split(".")
    if parts[:2] != ["encoder", "layer"]:
        return None
    layer = int(parts[2])
    return (
        None if layer < first_layer else ".".join(["layers", str(layer - first_layer), *parts[3:]])
    )


class EncoderTail(nn.Module):
    """BERT layers ``first_layer ..``: (residual stream, mask) in, last hidden state out."""

    def __init__(self, config: Any, first_layer: int) -> None:
        super().__init__()
        from transformers.models.bert.modeling_bert import BertLayer

        self.config = config
        self.first_layer = first_layer
        with torch.device("meta"):
            self.layers = nn.ModuleList(
                BertLayer(config, layer_idx=i)  # type: ignore[no-untyped-call]
                for i in range(first_layer, config.num_hidden_layers)
            )

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Last hidden state ``[batch, q, h]`` of ``hidden`` ``[batch, q, h]`` under ``mask``."""
        blocked = torch.finfo(hidden.dtype).min
        additive = (1.0 - mask[:, None, None, :].to(hidden.dtype)) * blocked
        for layer in self.layers:
            out = layer(hidden, attention_mask=additive)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden


def build_encoder_tail(architecture: str, config_json: str, first_layer: int) -> EncoderTail:
    """The tail's modules on ``meta`` (no dropout: the adapters are the only change)."""
    from transformers import BertConfig

    from edge_agent.training.errors import PlanMismatchError

    if architecture not in ENCODERS:
        raise PlanMismatchError(
            f"cannot train encoder {architecture!r}: known are {sorted(ENCODERS)}"
        )
    config = BertConfig.from_dict(json.loads(config_json))
    config.hidden_dropout_prob = 0.0
    config.attention_probs_dropout_prob = 0.0
    config._attn_implementation = "eager"
    return EncoderTail(config, first_layer)


def embed(tail: nn.Module, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings as the served model makes them: masked mean, L2-normalised."""
    out = tail(hidden, mask)
    weights = mask.unsqueeze(-1).to(out.dtype)
    pooled = (out * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    return F.normalize(pooled, p=2.0, dim=1)


def ranking_losses(anchors: torch.Tensor, positives: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-anchor cross-entropy of ``scale · cos(anchor_i, positive_j)`` against ``j = i``."""
    scores = scale * anchors @ positives.T
    return F.cross_entropy(scores, torch.arange(len(anchors)), reduction="none")


@dataclass(frozen=True)
class PairBatch:
    """Boundary activations and masks of the anchors and the positives of some pairs."""

    anchor: np.ndarray
    anchor_mask: np.ndarray
    positive: np.ndarray
    positive_mask: np.ndarray

    def __len__(self) -> int:
        return len(self.anchor)


def _embed_all(tail: nn.Module, hidden: np.ndarray, mask: np.ndarray) -> torch.Tensor:
    chunks = []
    for start in range(0, len(hidden), EVAL_BATCH):
        h = torch.from_numpy(hidden[start : start + EVAL_BATCH])
        m = torch.from_numpy(mask[start : start + EVAL_BATCH])
        chunks.append(embed(tail, h, m))
    return torch.cat(chunks)


def held_out_ranking(
    tail: nn.Module, pairs: PairBatch | None, scale: float
) -> tuple[float, float, int]:
    """(mean ranking loss, recall@1, pairs) over the whole held-out set; (NaN, NaN, 0) without."""
    if pairs is None or len(pairs) < 2:
        return float("nan"), float("nan"), 0
    with torch.no_grad():
        a = _embed_all(tail, pairs.anchor, pairs.anchor_mask)
        p = _embed_all(tail, pairs.positive, pairs.positive_mask)
        losses = ranking_losses(a, p, scale)
        best = (a @ p.T).argmax(dim=1)
    recall = float((best == torch.arange(len(a))).float().mean())
    return float(losses.mean()), recall, len(a)
