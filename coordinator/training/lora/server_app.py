"""The Flower ServerApp of federated LoRA: FedAvg over the adapters, under SecAgg+.

``flwr run`` starts it in the SuperLink's ``flwr-serverapp`` process; its run-config key
``run-file`` names a :class:`~coordinator.training.lora.records.LoraRunConfig`. Every fit
instruction carries the :class:`~protocols.lora.LoraPlan` (``fedshard-lora-plan``); the arrays
that travel are the adapters only. Record-level DP is the clients' (Opacus DP-SGD, each device's
RDP accountant): the server adds no noise, and under SecAgg+ sees only the sum. Every round's
record carries each device's epsilon, the held-out loss (and an encoder's recall@1) of the
adapters the round started from and the upload size; after the last round the clients evaluate
the final adapters: in clear without DP; under DP with SecAgg+ in one more fit round that trains
nothing (:data:`~protocols.lora.EVALUATE_ONLY_KEY`), whose masked vector carries only the
devices' held-out statistics, so the coordinator reads their means and no device's figure.

A round that no client finished (or whose secure aggregation did not complete) ends the run
with the reason in the record; nothing is saved, so nothing can be rolled out.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
from flwr.app import Context
from flwr.common import Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import LegacyContext, ServerConfig
from flwr.server.client_manager import ClientManager
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.serverapp import Grid, ServerApp

from coordinator.training import flower_types as fl
from coordinator.training.errors import TrainingRunError
from coordinator.training.lora.records import LoraRecord, LoraRound, LoraRunConfig, token_weighted
from coordinator.training.server_app import RUN_FILE_KEY, save_weights
from coordinator.training.strategy import failure_reasons
from partitioner.models.lora import initial_adapters
from protocols import lora as lora_wire
from protocols.lora import (
    EVALUATE_ONLY_KEY,
    LORA_PLAN_KEY,
    LoraPlan,
    carries_stats,
    max_reply_weight,
    read_stats,
)
from protocols.training import METRIC_LOSS, METRIC_UPLOAD_BYTES

log = logging.getLogger(__name__)


def round_of(
    server_round: int,
    results: fl.FitResults,
    failures: int,
    seconds: float,
    masked: tuple[float | None, float | None] = (None, None),
) -> LoraRound:
    """The recorded round from the clients' fit metrics (under DP, which sends no held-out loss
    or recall in clear, ``masked``: the devices' mean loss and recall@1 from the SecAgg+
    vector)."""
    metrics = [(str(proxy.node_id), res.metrics) for proxy, res in results]
    held, tokens = token_weighted(
        [
            (float(m[lora_wire.METRIC_HELD_OUT_LOSS]), int(m[lora_wire.METRIC_HELD_OUT_TOKENS]))
            for _, m in metrics
            if lora_wire.METRIC_HELD_OUT_LOSS in m and lora_wire.METRIC_HELD_OUT_TOKENS in m
        ]
    )
    recall, _ = token_weighted(
        [
            (float(m[lora_wire.METRIC_RECALL_AT_1]), int(m[lora_wire.METRIC_HELD_OUT_TOKENS]))
            for _, m in metrics
            if lora_wire.METRIC_RECALL_AT_1 in m and lora_wire.METRIC_HELD_OUT_TOKENS in m
        ]
    )
    train = [float(m[METRIC_LOSS]) for _, m in metrics if METRIC_LOSS in m]
    uploads = [float(m.get(METRIC_UPLOAD_BYTES, 0.0)) for _, m in metrics]
    if held is None:
        held = masked[0]
    if recall is None:
        recall = masked[1]
    return LoraRound(
        round=server_round,
        clients=len(results),
        failures=failures,
        held_out_loss=held,
        held_out_tokens=tokens,
        train_loss=float(np.mean(train)) if train else None,
        epsilon={
            n: float(m[lora_wire.METRIC_EPSILON])
            for n, m in metrics
            if lora_wire.METRIC_EPSILON in m
        },
        upload_bytes_per_client=float(np.mean(uploads)) if uploads else 0.0,
        trained_shard_bytes=max(
            (float(m.get(lora_wire.METRIC_TRAINED_BYTES, 0.0)) for _, m in metrics)
        ),
        seconds=seconds,
        held_out_recall=recall,
    )


class LoraFedAvg(FedAvg):
    """FedAvg over the adapters that records every round and fails the run on an empty one."""

    def __init__(self, plan: LoraPlan, cfg: LoraRunConfig, record_path: Path | None) -> None:
        plan_json = plan.model_dump_json()
        initial = initial_adapters(plan.adapters, plan.lora.rank, cfg.seed)
        super().__init__(
            fraction_fit=1.0,
            fraction_evaluate=1.0,
            min_fit_clients=cfg.min_clients,
            min_available_clients=cfg.min_clients,
            min_evaluate_clients=1,
            initial_parameters=ndarrays_to_parameters(initial),
            on_fit_config_fn=lambda rnd: {LORA_PLAN_KEY: plan_json, "round": rnd},
            on_evaluate_config_fn=lambda rnd: {LORA_PLAN_KEY: plan_json, "round": rnd},
            accept_failures=True,
        )
        self.cfg = cfg
        self.stats = carries_stats(plan, cfg.secagg)
        """Whether each reply's last array is the held-out statistics (DP under SecAgg+); then
        the round after the last is the evaluate-only round, the final evaluation."""
        self.dp = plan.dp is not None
        """Under DP no device answers a clear evaluation (nor is it asked for one)."""
        self.record = LoraRecord()
        self.record_path = record_path
        self.started = time.monotonic()
        self.latest: list[np.ndarray] = initial
        self._save()

    def _save(self) -> None:
        if self.record_path is not None:
            self.record.save(self.record_path)

    def fail(self, reason: str) -> TrainingRunError:
        """Record ``reason`` as the run's error; the exception to raise."""
        self.record = self.record.model_copy(update={"error": reason})
        self._save()
        return TrainingRunError(reason)

    def check_recorded(self, server_round: int) -> None:
        """Raise unless round ``server_round`` was aggregated (SecAgg+ may end a round early)."""
        if server_round > 0 and len(self.record.rounds) < server_round:
            raise self.fail(
                f"round {server_round} produced no aggregate (too few clients finished it)"
            )

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> fl.FitInstructions:
        """Refuse to go on after a round that ended without an aggregate."""
        self.check_recorded(server_round - 1)
        self.started = time.monotonic()
        instructions = super().configure_fit(server_round, parameters, client_manager)
        if self.evaluates(server_round):
            for _, ins in instructions:
                ins.config[EVALUATE_ONLY_KEY] = True
        return instructions

    @property
    def flower_rounds(self) -> int:
        """Rounds the workflow runs: the run's, and the evaluate-only one under DP and SecAgg+."""
        return self.cfg.rounds + (1 if self.stats else 0)

    def evaluates(self, server_round: int) -> bool:
        """Whether ``server_round`` is the evaluate-only round (trains nothing)."""
        return self.stats and server_round > self.cfg.rounds

    def aggregate_fit(
        self, server_round: int, results: fl.FitResults, failures: fl.FitFailures
    ) -> fl.FitAggregate:
        """Average the adapters and record the round; no successful client fails the run (the
        evaluate-only round leaves the final loss unknown instead)."""
        if not results and self.evaluates(server_round):
            log.warning("the final evaluation had no reply: %s", failure_reasons(failures))
            return ndarrays_to_parameters(self.latest), {}
        if not results:
            raise self.fail(
                f"round {server_round}: {len(results)} client(s) succeeded; "
                f"failures: {failure_reasons(failures)}"
            )
        params, metrics = super().aggregate_fit(server_round, results, failures)
        if params is None:
            raise self.fail(f"round {server_round}: no aggregate")
        aggregate = parameters_to_ndarrays(params)
        if self.evaluates(server_round):  # zero adapters and the final adapters' statistics
            loss, recall = read_stats(aggregate[-1])
            update = {"final_loss": loss, "final_tokens": 0, "final_recall": recall}
            self.record = self.record.model_copy(update=update)
            self._save()
            log.info("final evaluation (inside SecAgg+): held-out loss %s, recall@1 %s",
                     loss, recall)  # fmt: skip
            return ndarrays_to_parameters(self.latest), metrics
        self.latest = aggregate
        masked: tuple[float | None, float | None] = (None, None)
        if self.stats:  # the last array is the devices' held-out statistics, not an adapter
            self.latest, stats = self.latest[:-1], self.latest[-1]
            params = ndarrays_to_parameters(self.latest)
            masked = read_stats(stats)
        seconds = time.monotonic() - self.started
        done = round_of(server_round, results, len(failures), seconds, masked)
        self.record = self.record.model_copy(update={"rounds": [*self.record.rounds, done]})
        self._save()
        log.info("round %d: held-out loss %s, epsilon %s", server_round, done.held_out_loss,
                 done.epsilon)  # fmt: skip
        return params, metrics

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> fl.EvaluateInstructions:
        """Only the final adapters are evaluated (every round's fit reports the loss before),
        and in clear only without DP (under DP and SecAgg+ the evaluate-only round does it)."""
        if server_round != self.cfg.rounds or self.dp:
            return []
        return super().configure_evaluate(server_round, parameters, client_manager)

    def aggregate_evaluate(
        self, server_round: int, results: fl.EvaluateResults, failures: fl.EvaluateFailures
    ) -> fl.EvaluateAggregate:
        """Record the final adapters' token-weighted held-out loss (and encoders' recall@1)."""
        loss, tokens = token_weighted([(r.loss, r.num_examples) for _, r in results])
        recall, _ = token_weighted(
            [
                (float(r.metrics[lora_wire.METRIC_RECALL_AT_1]), r.num_examples)
                for _, r in results
                if lora_wire.METRIC_RECALL_AT_1 in r.metrics
            ]
        )
        update = {"final_loss": loss, "final_tokens": tokens, "final_recall": recall}
        self.record = self.record.model_copy(update=update)
        self._save()
        return loss, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> fl.ServerEvaluation:
        """No server-side evaluation: the held-out text stays on the devices."""
        return None


def workflow_for(cfg: LoraRunConfig, plan: LoraPlan) -> DefaultWorkflow:
    """The legacy workflow, with SecAgg+ over the fit replies when the run asks for it (its
    ``max_weight`` what the plan's replies weigh at most, so no quantization level is wasted)."""
    if not cfg.secagg:
        return DefaultWorkflow()
    return DefaultWorkflow(
        fit_workflow=SecAggPlusWorkflow(
            num_shares=cfg.num_shares,
            reconstruction_threshold=cfg.reconstruction_threshold,
            max_weight=max_reply_weight(plan),
            timeout=cfg.stage_timeout_s,
        )
    )


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the configured rounds, then save the final adapters (``.npz``)."""
    cfg = LoraRunConfig.from_json(Path(str(context.run_config[RUN_FILE_KEY])).read_bytes())
    plan = LoraPlan.from_json(Path(cfg.plan_file).read_bytes())
    strategy = LoraFedAvg(plan, cfg, Path(cfg.record_file))
    legacy = LegacyContext(
        context=context, config=ServerConfig(num_rounds=strategy.flower_rounds), strategy=strategy
    )
    try:
        workflow_for(cfg, plan)(grid, legacy)
        strategy.check_recorded(cfg.rounds)
    except TrainingRunError:
        raise
    except Exception as exc:
        raise strategy.fail(f"the run failed: {type(exc).__name__}: {exc}") from exc
    save_weights(Path(cfg.weights_file), strategy.latest)
    strategy.record = strategy.record.model_copy(update={"finished": True})
    strategy._save()
