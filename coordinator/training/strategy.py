"""Flower strategies: shard-wise FedAvg around FedAvg, optionally with client-side-clipping DP.

The composition, outermost first::

    ShardwiseStrategy                 rescales the all-client average per shard, evaluates,
      └── NoiseForActualClients       Flower's DifferentialPrivacyClientSideFixedClipping: sends
            └── FedAvg                the clipping norm, adds Gaussian noise to the average

With SecAgg+ the workflow hands FedAvg results that all carry the secure average, so FedAvg
returns it unchanged; without SecAgg+ FedAvg averages the individual replies. Either way the DP
noise lands on the all-client average before the shard-wise rescale (see
:mod:`coordinator.training.shardavg`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from flwr.common import Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.strategy import DifferentialPrivacyClientSideFixedClipping, Strategy

from coordinator.training import flower_types as fl
from coordinator.training.accounting import RoundAccountant
from coordinator.training.errors import TrainingRunError
from coordinator.training.records import RoundMetrics
from coordinator.training.shardavg import ShardLayout, parse_shards, shardwise_rescale
from protocols.training import (
    METRIC_EXAMPLES,
    METRIC_LOSS,
    METRIC_TRAINED_SHARDS,
    METRIC_UPLOAD_BYTES,
)

log = logging.getLogger(__name__)

Evaluator = Callable[[list[np.ndarray]], tuple[float, float]]
"""Global trainable arrays -> (held-out loss, held-out accuracy)."""


def capped_examples(results: fl.FitResults, cap: float | None) -> fl.FitResults:
    """Replies with each reported example count limited to ``cap`` (None: as reported)."""
    if cap is None:
        return results
    limit = max(1, int(cap))
    return [
        (proxy, dataclasses.replace(res, num_examples=min(max(res.num_examples, 0), limit)))
        for proxy, res in results
    ]


def _mean_finite(values: list[float], weights: list[float]) -> float | None:
    """Weighted mean over the finite values (a client that trained nothing reports NaN)."""
    pairs = [(v, w) for v, w in zip(values, weights, strict=True) if np.isfinite(v)]
    if not pairs:
        return None
    return float(np.average([v for v, _ in pairs], weights=[w for _, w in pairs]))


def failure_reasons(failures: fl.FitFailures) -> str:
    """The round's client failures in one line (``none`` when there were none)."""
    reasons = []
    for failure in failures:
        if isinstance(failure, BaseException):
            reasons.append(f"{type(failure).__name__}: {failure}")
        else:
            reasons.append(f"node {failure[0].node_id}: {failure[1].status.message}")
    return "; ".join(reasons)[:1000] or "none"


class NoiseForActualClients(DifferentialPrivacyClientSideFixedClipping):
    """Flower's client-side-clipping DP wrapper, calibrated to the clients that answered.

    The stock wrapper refuses a round with any failure and always divides the noise by the
    configured number of clients. A dropped client leaves fewer contributions, so the average's
    sensitivity is ``C / len(results)``; the noise is scaled to that, keeping the multiplier.
    """

    def aggregate_fit(
        self, server_round: int, results: fl.FitResults, failures: fl.FitFailures
    ) -> fl.FitAggregate:
        """Average with the inner strategy, then add noise for ``len(results)`` clients."""
        if failures:
            log.warning(
                "round %d: %d client(s) failed; averaging the rest", server_round, len(failures)
            )
        if not results:
            return None, {}
        self.num_sampled_clients = len(results)
        return super().aggregate_fit(server_round, results, [])


@dataclass
class _FitSummary:
    clients: int = 0
    loss: float | None = None
    epsilon: float | None = None
    upload: float = 0.0
    trained: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class _RoundState:
    started: float = 0.0
    global_arrays: list[np.ndarray] = field(default_factory=list)
    fit: _FitSummary = field(default_factory=_FitSummary)


class ShardwiseStrategy(Strategy):
    """Shard-wise FedAvg, DP accounting, held-out evaluation and per-round metrics."""

    def __init__(
        self,
        inner: Strategy,
        layout: ShardLayout,
        evaluator: Evaluator,
        *,
        min_clients: int,
        accountant: RoundAccountant | None = None,
        noise_multiplier: float | None = None,
        full_model_bytes: int = 0,
        on_round: Callable[[RoundMetrics], None] | None = None,
        on_weights: Callable[[int, list[np.ndarray]], None] | None = None,
        max_examples: float | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.layout = layout
        self.evaluator = evaluator
        self.min_clients = min_clients
        self.accountant = accountant
        self.noise_multiplier = noise_multiplier
        self.full_model_bytes = full_model_bytes
        self.on_round = on_round
        self.on_weights = on_weights
        self.max_examples = max_examples
        """Most examples one client's reply may weigh (its own count is not trusted: one
        device reporting a huge count would dominate the average); SecAgg+'s ``max_weight``."""
        self._round = _RoundState()

    def __repr__(self) -> str:
        return f"ShardwiseStrategy({self.inner!r})"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        """The inner strategy's initial parameters (the current version's trainable weights)."""
        return self.inner.initialize_parameters(client_manager)

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> fl.FitInstructions:
        """Remember the global arrays the round starts from, then let the inner strategy sample."""
        self._round = _RoundState(
            started=time.monotonic(), global_arrays=parameters_to_ndarrays(parameters)
        )
        return self.inner.configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(
        self, server_round: int, results: fl.FitResults, failures: fl.FitFailures
    ) -> fl.FitAggregate:
        """Average (securely, noisily) over all clients, then rescale shard by shard."""
        if len(results) < self.min_clients:
            raise TrainingRunError(
                f"round {server_round}: {len(results)} client(s) succeeded, {self.min_clients} "
                f"needed; failures: {failure_reasons(failures)}"
            )
        results = capped_examples(results, self.max_examples)
        averaged, _ = self.inner.aggregate_fit(server_round, results, failures)
        if averaged is None:
            return None, {}
        weights = [float(res.num_examples) for _, res in results]
        trained = [
            parse_shards(str(res.metrics.get(METRIC_TRAINED_SHARDS, ""))) for _, res in results
        ]
        new = shardwise_rescale(
            self._round.global_arrays,
            parameters_to_ndarrays(averaged),
            weights,
            trained,
            self.layout,
        )
        examples = [float(res.metrics.get(METRIC_EXAMPLES, res.num_examples)) for _, res in results]
        losses = [float(res.metrics.get(METRIC_LOSS, float("nan"))) for _, res in results]
        uploads = [float(res.metrics.get(METRIC_UPLOAD_BYTES, 0.0)) for _, res in results]
        epsilon = None
        if self.accountant is not None and self.noise_multiplier:
            epsilon = self.accountant.record_round(self.noise_multiplier, len(results))
        self._round.fit = _FitSummary(
            clients=len(results),
            loss=_mean_finite(losses, examples),
            epsilon=epsilon,
            upload=float(np.mean(uploads)) if uploads else 0.0,
            trained={
                str(proxy.node_id): sorted(t)
                for (proxy, _), t in zip(results, trained, strict=True)
            },
        )
        return ndarrays_to_parameters(new), {"clients": len(results)}

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> fl.EvaluateInstructions:
        """No federated evaluation: the held-out set lives on the coordinator."""
        return []

    def aggregate_evaluate(
        self, server_round: int, results: fl.EvaluateResults, failures: fl.EvaluateFailures
    ) -> fl.EvaluateAggregate:
        """Nothing to aggregate (see :meth:`configure_evaluate`)."""
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> fl.ServerEvaluation:
        """Held-out loss and accuracy; after a round, also publish that round's weights (first)
        and metrics."""
        arrays = parameters_to_ndarrays(parameters)
        loss, accuracy = self.evaluator(arrays)
        fit = self._round.fit
        if server_round > 0 and self.on_weights is not None:
            self.on_weights(server_round, arrays)
        if server_round > 0 and self.on_round is not None:
            self.on_round(
                RoundMetrics(
                    round=server_round,
                    loss=fit.loss,
                    test_loss=loss,
                    accuracy=accuracy,
                    epsilon=fit.epsilon,
                    clients=fit.clients,
                    trained_shards=fit.trained,
                    upload_bytes_per_client=fit.upload,
                    full_model_bytes=self.full_model_bytes,
                    seconds=time.monotonic() - self._round.started,
                )
            )
        return loss, {"accuracy": accuracy}
