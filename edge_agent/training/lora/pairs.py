"""One round of federated LoRA for an encoder: text pairs, contrastive loss, DP-SGD via Opacus.

The steps are the decoder's (:mod:`.train`): the version's ``tokenizer.json`` (hash-checked)
encodes anchors and positives, without its fixed padding and truncated to ``max_tokens`` with the
closing ``[SEP]`` kept; the frozen segments run in ONNX Runtime, one at a time, up to the plan's
boundary (with the real attention mask: BERT attends both ways, so pads must be masked), and
their output is cached on disk; the tail (:mod:`.encoder`) trains only its adapters.

Privacy: under ``plan.dp`` Opacus clips each *pair*'s gradient (its anchor pass and its positive
pass sum into one per-sample gradient) and adds Gaussian noise; the RDP accountant composes the
run's rounds as for decoders. With in-batch negatives a pair also appears as a negative in the
other pairs' losses, which that per-pair clipping does not bound, so for the contrastive
objective the reported epsilon is the accountant's figure for the clipped per-pair gradients,
not a formal record-level guarantee (the causal-LM objective's is one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_agent.training.errors import PlanMismatchError
from edge_agent.training.local import LocalSettings
from edge_agent.training.lora.encoder import ENCODERS, PairBatch
from edge_agent.training.text_data import load_pairs
from protocols.lora import METRIC_RECALL_AT_1, LoraPlan


def encode(texts: tuple[str, ...], tokenizer_path: Path, max_tokens: int) -> Any:
    """Token ids of ``texts`` (no padding; truncated to ``max_tokens`` with special tokens)."""
    from tokenizers import Tokenizer

    from edge_agent.training.lora.train import Tokens

    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.no_padding()
    tok.enable_truncation(max_tokens)
    encoded = [tok.encode(t).ids for t in texts]
    width = max(len(e) for e in encoded)
    ids = np.zeros((len(encoded), width), dtype=np.int64)
    for row, e in enumerate(encoded):
        ids[row, : len(e)] = e
    return Tokens(ids, np.array([len(e) for e in encoded], dtype=np.int64))


def _mask(tokens: Any) -> np.ndarray:
    width = tokens.ids.shape[1]
    mask: np.ndarray = (np.arange(width)[None, :] < tokens.lengths[:, None]).astype(np.int64)
    return mask


@dataclass
class PreparedPairs:
    """A device's contrastive round, ready to train."""

    tail: Any
    pairs: list[Any]
    train: PairBatch
    held_out: PairBatch | None
    examples: int
    trained_shard_bytes: int


def _batch(
    plan: LoraPlan, blobs: Sequence[bytes], pairs: Any, key: str, settings: LocalSettings
) -> PairBatch:
    from edge_agent.training.lora.train import TOKENIZER_FILE, cached_prefix

    tok_path = settings.segments_dir / TOKENIZER_FILE
    sides = []
    for side, texts in (
        ("anchor", tuple(a for a, _ in pairs)),
        ("positive", tuple(p for _, p in pairs)),
    ):
        tokens = encode(texts, tok_path, plan.max_tokens)
        hidden = cached_prefix(plan, blobs, tokens, f"{key}/{side}", settings.cache_dir)
        sides.append((hidden, _mask(tokens)))
    return PairBatch(sides[0][0], sides[0][1], sides[1][0], sides[1][1])


def prepare_pairs(
    plan: LoraPlan, arrays: list[np.ndarray], settings: LocalSettings
) -> PreparedPairs:
    """Read the pairs, run (or reuse) the frozen prefix on both sides, build the tail."""
    from edge_agent.training.lora.model import (
        adapter_pairs,
        build_tail,
        set_adapters,
        tail_initializers,
    )
    from edge_agent.training.lora.train import load_version, trainable_initializers

    if plan.architecture not in ENCODERS or plan.objective != "contrastive":
        raise PlanMismatchError(f"{plan.architecture} with {plan.objective!r} is no encoder plan")
    records = load_pairs(settings.data_dir)
    _, blobs = load_version(plan, settings.segments_dir)
    train = _batch(plan, blobs, records.train, records.sha256 + "/train", settings)
    held = None
    if len(records.held_out) >= 2:
        held = _batch(plan, blobs, records.held_out, records.sha256 + "/held", settings)
    weights, trained_bytes = trainable_initializers(plan, blobs, tail_initializers(plan))
    del blobs
    tail = build_tail(plan, weights)
    pairs = adapter_pairs(tail, plan)
    set_adapters(pairs, arrays)
    return PreparedPairs(tail, pairs, train, held, len(records.train), trained_bytes)


def run_contrastive_epochs(
    tail: Any,
    plan: LoraPlan,
    data: PairBatch,
    seed: int | None,
    cache_dir: Path,
    round_number: int,
) -> Any:
    """Train the adapters for ``plan.local_epochs`` epochs (in-batch negatives; DP by plan)."""
    from torch.utils.data import DataLoader, TensorDataset

    from edge_agent.training.lora.encoder import embed, ranking_losses
    from edge_agent.training.lora.loop import shuffle_generator, train_adapters

    tensors = [
        torch.from_numpy(x)
        for x in (data.anchor, data.anchor_mask, data.positive, data.positive_mask)
    ]
    loader = DataLoader(
        TensorDataset(*tensors),
        batch_size=plan.batch_size,
        shuffle=True,
        generator=shuffle_generator(plan.dp, seed),
    )

    def losses(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor | None:
        a, am, p, pm = batch
        if len(a) < 2:  # in-batch negatives need another pair
            return None
        return ranking_losses(embed(model, a, am), embed(model, p, pm), plan.contrastive_scale)

    return train_adapters(tail, plan, loader, losses, cache_dir, round_number)


def evaluate_pairs(
    plan: LoraPlan, arrays: list[np.ndarray], settings: LocalSettings
) -> tuple[float, int, dict[str, float]]:
    """(held-out ranking loss, held-out pairs, {recall@1}) of the model with ``arrays``."""
    from edge_agent.training.lora.encoder import held_out_ranking

    ready = prepare_pairs(plan, arrays, settings)
    loss, recall, count = held_out_ranking(ready.tail, ready.held_out, plan.contrastive_scale)
    return loss, count, {METRIC_RECALL_AT_1: recall}


def train_pairs(
    plan: LoraPlan,
    arrays: list[np.ndarray],
    settings: LocalSettings,
    seed: int | None,
    round_number: int,
) -> Any:
    """One contrastive round on this device; a :class:`~.train.LoraResult`."""
    from edge_agent.training.lora.encoder import held_out_ranking
    from edge_agent.training.lora.train import lora_result

    ready = prepare_pairs(plan, arrays, settings)
    scale = plan.contrastive_scale
    before = held_out_ranking(ready.tail, ready.held_out, scale)
    loop = run_contrastive_epochs(
        ready.tail, plan, ready.train, seed, settings.cache_dir, round_number
    )
    after = held_out_ranking(ready.tail, ready.held_out, scale)
    return lora_result(ready, loop, before[0], after[0], before[2], {METRIC_RECALL_AT_1: before[1]})
