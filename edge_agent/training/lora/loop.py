"""The training loop of a LoRA round: causal-LM loss, Adam on the adapters, DP-SGD via Opacus.

Under DP, Opacus' ``PrivacyEngine.make_private`` wraps the tail (per-example gradients of the
adapter layers, which are plain ``nn.Linear`` s), the optimizer (clip each example's gradient to
``max_grad_norm``, add ``N(0, (noise_multiplier · max_grad_norm)^2)`` to the sum) and the data
loader (Poisson sampling at rate ``batch_size / records``), with every random draw from
``os.urandom`` (:mod:`.dp`). Its RDP accountant's history is
stored per run and round in the cache dir, so the epsilon reported after round ``r`` composes
rounds ``1..r`` of this run on this device, whichever process ran them.

torch runs these small tails on :data:`THREADS_ENV` intra-op threads (default 1): on a shared
2-core machine two OpenMP threads made a tiny-Llama DP round 2.5x slower in wall time and 2.4x
more CPU time than one (threads spin while the other core is busy).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from edge_agent.training.lora.dp import check_seed, make_private, secure_generator
from protocols.lora import LoraPlan, RecordDp

if TYPE_CHECKING:
    from edge_agent.training.lora.model import DecoderTail
    from edge_agent.training.lora.train import Tokens

log = logging.getLogger(__name__)
IGNORE = -100
THREADS_ENV = "FEDSHARD_TRAIN_THREADS"


@contextmanager
def train_threads() -> Iterator[None]:
    """Set torch's intra-op threads to ``$FEDSHARD_TRAIN_THREADS`` (default 1), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(os.environ.get(THREADS_ENV, "1"))))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class LoopResult:
    """Mean training loss of the last epoch and the run's epsilon so far (None without DP)."""

    loss: float
    epsilon: float | None
    mechanism: tuple[float, float, int] | None = None
    """Under DP: this round's (noise multiplier, sample rate, steps), as the accountant saw."""


def _labels(tokens: Tokens) -> torch.Tensor:
    """Next-token targets; pads and each row's last real token are ignored."""
    ids = torch.from_numpy(tokens.ids)
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:]
    width = ids.shape[1]
    real = torch.arange(width)[None, :] < torch.from_numpy(tokens.lengths)[:, None] - 1
    return torch.where(real, labels, torch.full_like(labels, IGNORE))


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of each example ``[batch]``."""
    flat = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE,
        reduction="none",
    ).reshape(labels.shape)  # fmt: skip
    counts = (labels != IGNORE).sum(dim=1).clamp(min=1)
    return flat.sum(dim=1) / counts


def held_out_loss(
    tail: DecoderTail, hidden: np.ndarray | None, tokens: Tokens | None
) -> tuple[float, int]:
    """(mean token loss, tokens) on held-out records; (NaN, 0) without any."""
    if hidden is None or tokens is None:
        return float("nan"), 0
    labels = _labels(tokens)
    positions = torch.arange(labels.shape[1])[None, :]
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(labels), 32):
            h = torch.from_numpy(hidden[start : start + 32])
            logits = tail(h, positions.expand(len(h), -1))
            lab = labels[start : start + 32]
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), ignore_index=IGNORE,
                reduction="sum",
            )  # fmt: skip
            total += float(loss)
            count += int((lab != IGNORE).sum())
    return total / max(count, 1), count


def _history_path(cache_dir: Path, run: str) -> Path:
    return cache_dir / f"dp-history-{run}.json"


def _load_history(path: Path) -> dict[str, list[float]]:
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {str(k): [float(x) for x in v] for k, v in raw.items()}


def run_epochs(
    tail: DecoderTail,
    plan: LoraPlan,
    hidden: np.ndarray,
    tokens: Tokens,
    seed: int | None,
    cache_dir: Path,
    round_number: int,
) -> LoopResult:
    """Train the adapters for ``plan.local_epochs`` epochs (privately when ``plan.dp``, whose
    randomness comes from ``os.urandom``: ``seed`` must then be None, see :mod:`.dp`)."""
    from torch.utils.data import DataLoader, TensorDataset

    labels = _labels(tokens)
    positions = torch.arange(labels.shape[1])[None, :].expand(len(labels), -1).contiguous()
    data = TensorDataset(torch.from_numpy(hidden), positions, labels)
    loader = DataLoader(
        data, batch_size=plan.batch_size, shuffle=True, generator=shuffle_generator(plan.dp, seed)
    )

    def losses(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor | None:
        h, pos, lab = batch
        return None if len(h) == 0 else per_example_loss(model(h, pos), lab)

    return train_adapters(tail, plan, loader, losses, cache_dir, round_number)


def shuffle_generator(dp: RecordDp | None, seed: int | None) -> torch.Generator:
    """The shuffle's generator of a round without DP (``seed``, or urandom when None); under DP
    the Poisson sampler replaces it (:func:`.dp.make_private`) and a seed is refused."""
    check_seed(dp, seed)
    if seed is None:
        return secure_generator()
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


BatchLosses = Callable[[torch.nn.Module, list[torch.Tensor]], "torch.Tensor | None"]
"""Per-example losses of one batch under the (possibly private) model; None skips the batch."""


def train_adapters(
    tail: torch.nn.Module,
    plan: LoraPlan,
    loader: Any,
    losses: BatchLosses,
    cache_dir: Path,
    round_number: int,
) -> LoopResult:
    """Adam on the tail's trainable parameters for ``plan.local_epochs`` epochs over ``loader``,
    privately when ``plan.dp`` (Opacus wraps tail, optimizer and loader); the last epoch's mean
    loss and the run's epsilon so far."""
    optimizer: torch.optim.Optimizer = torch.optim.Adam(
        [p for p in tail.parameters() if p.requires_grad], lr=plan.learning_rate
    )
    model: torch.nn.Module = tail
    tail.train()  # Opacus refuses a module in eval mode
    engine = None
    if plan.dp is not None:
        engine, model, optimizer, loader = make_private(tail, optimizer, loader, plan.dp)
    model.train()
    loss_sum, seen = 0.0, 0
    for _ in range(plan.local_epochs):
        loss_sum, seen = 0.0, 0
        for batch in loader:
            batch_losses = losses(model, list(batch))
            if batch_losses is None:
                continue
            optimizer.zero_grad()
            batch_losses.mean().backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            loss_sum += float(batch_losses.detach().sum())
            seen += len(batch_losses)
    model.eval()
    if engine is None:
        return LoopResult(loss_sum / max(seen, 1), None)
    epsilon = compose_epsilon(engine, plan, cache_dir, round_number)
    return LoopResult(loss_sum / max(seen, 1), epsilon, round_mechanism(engine))


def round_mechanism(engine: Any) -> tuple[float, float, int]:
    """(noise multiplier, sample rate, steps) of the round an Opacus engine ran."""
    history = engine.accountant.history
    if not history:
        return 1.0, 1.0, 0  # no step was taken: nothing released by the optimizer
    steps = sum(int(s) for _, _, s in history)
    return float(history[0][0]), float(history[0][1]), steps


def compose_epsilon(engine: object, plan: LoraPlan, cache_dir: Path, round_number: int) -> float:
    """Store this round's accountant history; epsilon over every stored round of the run."""
    from opacus.accountants import RDPAccountant

    assert plan.dp is not None
    path = _history_path(cache_dir, plan.run)
    history = _load_history(path)
    noise, rate, steps = round_mechanism(engine)
    history[str(round_number)] = [float(noise), float(rate), float(steps)]
    cache_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(history))
    total = RDPAccountant()
    total.history = [(n, q, int(s)) for n, q, s in history.values()]
    return float(total.get_epsilon(delta=plan.dp.delta))
