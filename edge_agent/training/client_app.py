"""The Flower ClientApp an agent runs when it has training data.

Two apps share one client: :data:`secagg_app` (``mods=[upload_meter_mod, secaggplus_mod,
dp_clipping_mod]``) for rounds under SecAgg+, and :data:`plain_app` without SecAgg+ (a ClientApp
with ``secaggplus_mod`` cannot serve plain rounds). ``dp_clipping_mod`` runs Flower's
``fixedclipping_mod`` whenever the server's DP wrapper sent a clipping norm, so the update is
clipped before SecAgg+ masks it. Node config (``flower-supernode --node-config``):
``segments-dir``, ``data-dir``, ``cache-dir``, ``budget-bytes``, and for an agent's SuperNode
its privacy policy: ``ledger-file``, ``privacy-budget``, ``allow-non-dp``, ``allow-non-secagg``.

Privacy (:mod:`protocols.privacy`): the innermost mod of each app sets the fit config's
:data:`~protocols.privacy.SECAGG_CONFIG_KEY` (True only behind ``secaggplus_mod``, whatever the
server sent), so the device knows whether its reply is masked. With a ledger, each round is
checked against the operator's policy and budget before it trains (a declined round fails with
a :class:`~protocols.ledger.DeclineReason`) and written to the ledger before its reply leaves.
Under DP the reply holds only :func:`~protocols.privacy.reply_fields` (no count, no loss, no
memory figure); the rest stays in :attr:`ShardClient.local_metrics`, and the held-out loss and
recall@1 travel inside the SecAgg+ vector (:func:`~protocols.lora.stats_array`), in each round
and in the evaluate-only round after the last; a clear evaluation under DP is refused. A DP
round's randomness comes from ``os.urandom``; the ``crc32(node/round)`` seed is for rounds
without DP only.

torch is imported only when a round actually trains, so the SecAgg+ key-exchange stages start
quickly.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path

import numpy as np
from flwr.app import Context, Message, MessageType
from flwr.client import Client, NumPyClient
from flwr.client.mod import fixedclipping_mod, secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import NDArrays, Scalar
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from edge_agent.training.errors import ClearReleaseError, PlanMismatchError
from edge_agent.training.ledger import (
    PrivacyPolicy,
    ceil_significant,
    check_round,
    planned_mechanism,
    record_round,
    version_digest,
)
from edge_agent.training.local import LocalSettings, load_train_data, train_locally
from edge_agent.training.text_data import load_pairs, load_text
from protocols.errors import SchemaError
from protocols.ledger import LedgerDp
from protocols.lora import (
    DP_REPLY_WEIGHT,
    EVALUATE_ONLY_KEY,
    LORA_PLAN_KEY,
    METRIC_EPSILON,
    METRIC_HELD_OUT_LOSS,
    METRIC_HELD_OUT_TOKENS,
    METRIC_PEAK_RSS,
    METRIC_RECALL_AT_1,
    METRIC_TRAINED_BYTES,
    LoraPlan,
    carries_stats,
    reply_weight,
    stats_array,
)
from protocols.privacy import SECAGG_CONFIG_KEY, reply_fields
from protocols.training import (
    METRIC_ACCURACY,
    METRIC_EXAMPLES,
    METRIC_LOSS,
    METRIC_TRAINED_SHARDS,
    METRIC_UPLOAD_BYTES,
    TRAIN_PLAN_KEY,
    TrainPlan,
)

log = logging.getLogger(__name__)

FIT_CONFIG_RECORD = "fitins.config"
FIT_METRICS_RECORD = "fitres.metrics"
DEFAULT_BUDGET_BYTES = 1 << 30


def _flag(node_config: dict[str, object], key: str) -> bool:
    return str(node_config.get(key, "false")).lower() == "true"


def policy_from_node_config(node_config: dict[str, object]) -> PrivacyPolicy | None:
    """The privacy policy of an agent's SuperNode (None when its node config names no ledger)."""
    if "ledger-file" not in node_config:
        return None
    budget = node_config.get("privacy-budget")
    return PrivacyPolicy(
        ledger_file=Path(str(node_config["ledger-file"])),
        budget=None if budget is None else float(str(budget)),
        allow_non_dp=_flag(node_config, "allow-non-dp"),
        allow_non_secagg=_flag(node_config, "allow-non-secagg"),
    )


def settings_from_node_config(node_config: dict[str, object]) -> LocalSettings:
    """Read this node's settings from its ``--node-config``."""
    try:
        return LocalSettings(
            segments_dir=Path(str(node_config["segments-dir"])),
            data_dir=Path(str(node_config["data-dir"])),
            cache_dir=Path(str(node_config["cache-dir"])),
            budget_bytes=int(str(node_config.get("budget-bytes", DEFAULT_BUDGET_BYTES))),
            privacy=policy_from_node_config(node_config),
        )
    except KeyError as exc:
        raise PlanMismatchError(f"node config lacks {exc}") from exc


def lora_data(plan: LoraPlan, data_dir: Path) -> tuple[str, int]:
    """(digest of the records, training records) of this device's data for ``plan``."""
    records = load_pairs(data_dir) if plan.objective == "contrastive" else load_text(data_dir)
    return records.sha256, len(records.train)


def private_reply(metrics: dict[str, Scalar]) -> dict[str, Scalar]:
    """The metrics a DP round may send (:func:`~protocols.privacy.reply_fields`), epsilon
    rounded up to 2 significant digits."""
    allowed = reply_fields(dp=True)
    out = {k: v for k, v in metrics.items() if k in allowed}
    if METRIC_EPSILON in out:
        out[METRIC_EPSILON] = ceil_significant(float(out[METRIC_EPSILON]))
    return out


class ShardClient(NumPyClient):
    """Trains the shards that fit; returns every plan array (untrained ones unchanged)."""

    def __init__(self, settings: LocalSettings, node_id: int, *, over_wire: bool = False) -> None:
        self.settings = settings
        self.node_id = node_id
        self.over_wire = over_wire
        """True for the client Flower runs (:func:`client_fn`): its replies leave the device, so
        under DP it refuses a clear evaluation. An in-process lab (the records' owner) leaves it
        False and reads every figure."""
        self.local_metrics: dict[str, Scalar] = {}
        """Every metric of the last fit, sent or not (for in-process labs; never sent)."""

    def fit(
        self, parameters: NDArrays, config: dict[str, Scalar]
    ) -> tuple[NDArrays, int, dict[str, Scalar]]:
        """One round of local training on this device's data (LoRA when the plan says so)."""
        if LORA_PLAN_KEY in config:
            return self.fit_lora(parameters, config)
        try:
            plan = TrainPlan.from_json(str(config[TRAIN_PLAN_KEY]))
        except (KeyError, SchemaError) as exc:
            raise PlanMismatchError(f"the fit config carries no valid train plan: {exc}") from exc
        server_round = int(config.get("round", 0))
        secagg = config.get(SECAGG_CONFIG_KEY) is True
        policy = self.settings.privacy
        if policy is not None:  # the device adds no noise here: a round without local DP
            check_round(policy, None, secagg)
        seed = zlib.crc32(f"{self.node_id}/{server_round}".encode())
        result = train_locally(plan, [np.asarray(a) for a in parameters], self.settings, seed)
        if policy is not None:
            digest = load_train_data(self.settings.data_dir)[2]
            record_round(policy, digest, "shards", server_round, None, secagg)
        weight = 1 if plan.uniform_weights else result.examples
        log.info(
            "trained shards %s on %d examples: loss %.4f",
            result.trained,
            result.examples,
            result.loss,
        )
        return (
            result.arrays,
            weight,
            {
                METRIC_TRAINED_SHARDS: ",".join(str(i) for i in result.trained),
                METRIC_EXAMPLES: result.examples,
                METRIC_LOSS: result.loss,
                METRIC_ACCURACY: result.accuracy,
                METRIC_UPLOAD_BYTES: float(sum(a.nbytes for a in result.arrays)),
            },
        )

    def fit_lora(
        self, parameters: NDArrays, config: dict[str, Scalar]
    ) -> tuple[NDArrays, int, dict[str, Scalar]]:
        """One LoRA round: only the adapters come back, with held-out loss and epsilon."""
        from edge_agent.training.lora.train import train_lora

        try:
            plan = LoraPlan.from_json(str(config[LORA_PLAN_KEY]))
        except SchemaError as exc:
            raise PlanMismatchError(f"the fit config carries no valid LoRA plan: {exc}") from exc
        server_round = int(config.get("round", 0))
        secagg = config.get(SECAGG_CONFIG_KEY) is True
        if config.get(EVALUATE_ONLY_KEY) is True:
            return self.evaluate_only(plan, [np.asarray(a) for a in parameters], secagg)
        policy = self.settings.privacy
        digest = ""
        if policy is not None:
            digest, records = lora_data(plan, self.settings.data_dir)
            planned = None
            if plan.dp is not None:
                dp = plan.dp
                planned = planned_mechanism(
                    dp.noise_multiplier, dp.delta, records, plan.batch_size, plan.local_epochs
                )
            check_round(policy, planned, secagg)
        # under DP every random draw is the device's own (os.urandom): no seed anyone can know
        seed = (
            None if plan.dp is not None else zlib.crc32(f"{self.node_id}/{server_round}".encode())
        )
        arrays = [np.asarray(a) for a in parameters]
        result = train_lora(plan, arrays, self.settings, seed, server_round)
        if policy is not None:
            mechanism = None
            if plan.dp is not None and result.mechanism is not None:
                noise, rate, steps = result.mechanism
                mechanism = LedgerDp(
                    noise_multiplier=noise, sample_rate=rate, steps=steps, delta=plan.dp.delta
                )
            version = version_digest([s.sha256 for s in plan.segments])
            record_round(policy, digest, plan.run, server_round, mechanism, secagg, version)
        log.info(
            "LoRA round %d on %d records: held-out loss %.4f -> %.4f, epsilon %s",
            server_round, result.examples, result.held_out_before, result.held_out_after,
            result.epsilon,
        )  # fmt: skip
        metrics: dict[str, Scalar] = {
            METRIC_TRAINED_SHARDS: ",".join(str(i) for i in plan.trainable),
            METRIC_EXAMPLES: result.examples,
            METRIC_LOSS: result.train_loss,
            METRIC_HELD_OUT_LOSS: result.held_out_before,
            METRIC_HELD_OUT_TOKENS: result.held_out_tokens,
            METRIC_TRAINED_BYTES: result.trained_shard_bytes,
            METRIC_UPLOAD_BYTES: float(sum(a.nbytes for a in result.arrays)),
            METRIC_PEAK_RSS: result.peak_rss_bytes,
        }
        if result.epsilon is not None:
            metrics[METRIC_EPSILON] = result.epsilon
        metrics.update(result.extra)  # an encoder's held-out recall@1
        self.local_metrics = dict(metrics)
        arrays = result.arrays
        if plan.dp is not None:
            metrics = private_reply(metrics)
        if carries_stats(plan, secagg):
            recall = result.extra.get(METRIC_RECALL_AT_1)
            arrays = [*arrays, stats_array(result.held_out_before, recall)]
        return arrays, reply_weight(plan, result.examples), metrics

    def evaluate_only(
        self, plan: LoraPlan, arrays: list[np.ndarray], secagg: bool
    ) -> tuple[NDArrays, int, dict[str, Scalar]]:
        """The evaluate-only round (:data:`~protocols.lora.EVALUATE_ONLY_KEY`): nothing trains
        (no epsilon spent, no ledger line); the reply is zero adapters and, under DP with SecAgg+,
        the held-out statistics of ``arrays`` inside the masked vector (a DP reply without
        SecAgg+ carries none)."""
        from edge_agent.training.lora.train import evaluate_lora_metrics

        policy = self.settings.privacy
        if policy is not None and plan.dp is None:  # its figures leave in clear
            check_round(policy, None, secagg)
        loss, count, extra = evaluate_lora_metrics(plan, arrays, self.settings)
        reply: NDArrays = [np.zeros_like(a) for a in arrays]
        metrics: dict[str, Scalar] = {
            METRIC_TRAINED_SHARDS: ",".join(str(i) for i in plan.trainable),
            METRIC_HELD_OUT_LOSS: loss,
            METRIC_HELD_OUT_TOKENS: count,
            METRIC_UPLOAD_BYTES: float(sum(a.nbytes for a in reply)),
            **extra,
        }
        self.local_metrics = dict(metrics)
        if plan.dp is not None:
            metrics = private_reply(metrics)
        if carries_stats(plan, secagg):
            reply.append(stats_array(loss, extra.get(METRIC_RECALL_AT_1)))
        log.info("LoRA evaluation of the final adapters: held-out loss %.4f", loss)
        return reply, DP_REPLY_WEIGHT, metrics

    def evaluate(
        self, parameters: NDArrays, config: dict[str, Scalar]
    ) -> tuple[float, int, dict[str, Scalar]]:
        """Held-out loss of the global adapters on this device's held-out records (LoRA only).
        Over the wire a DP plan's evaluation is refused (:class:`ClearReleaseError`): it would
        release the loss in clear; the run's final evaluation is the evaluate-only fit round."""
        from edge_agent.training.lora.train import evaluate_lora_metrics

        if LORA_PLAN_KEY not in config:
            raise PlanMismatchError("evaluation needs a LoRA plan")
        plan = LoraPlan.from_json(str(config[LORA_PLAN_KEY]))
        if plan.dp is not None and self.over_wire:
            raise ClearReleaseError(
                "a DP run's held-out evaluation leaves this device only inside SecAgg+ "
                f"(the evaluate-only fit round, {EVALUATE_ONLY_KEY}), never in clear"
            )
        arrays = [np.asarray(a) for a in parameters]
        loss, tokens, extra = evaluate_lora_metrics(plan, arrays, self.settings)
        return loss, tokens, {METRIC_HELD_OUT_TOKENS: tokens, **extra}


def client_fn(context: Context) -> Client:
    """Build this node's client from its node config."""
    settings = settings_from_node_config(dict(context.node_config))
    return ShardClient(settings, context.node_id, over_wire=True).to_client()


def dp_clipping_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``fixedclipping_mod`` for rounds whose server asked for clipping, else a no-op."""
    if msg.metadata.message_type == MessageType.TRAIN:
        config = msg.content.config_records.get(FIT_CONFIG_RECORD)
        if config is not None and KEY_CLIPPING_NORM in config:
            return fixedclipping_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)


def _mark_secagg(msg: Message, masked: bool) -> None:
    if msg.metadata.message_type == MessageType.TRAIN:
        config = msg.content.config_records.get(FIT_CONFIG_RECORD)
        if config is not None:
            config[SECAGG_CONFIG_KEY] = masked


def secagg_mark_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Tell the client its reply is masked (it sits right inside ``secaggplus_mod``, which calls
    it only at the stage that masks the reply)."""
    _mark_secagg(msg, True)
    return call_next(msg, ctxt)


def plain_mark_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Tell the client its reply leaves unmasked (whatever the server's config said)."""
    _mark_secagg(msg, False)
    return call_next(msg, ctxt)


def upload_meter_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Replace the ``upload-bytes`` metric with the size of the update message actually sent.

    Sits outermost, so under SecAgg+ it measures the masked vector, not the float weights.
    """
    out = call_next(msg, ctxt)
    if msg.metadata.message_type == MessageType.TRAIN and not out.has_error():
        metrics = out.content.config_records.get(FIT_METRICS_RECORD)
        if metrics is not None:
            metrics[METRIC_UPLOAD_BYTES] = float(
                sum(record.count_bytes() for record in out.content.values())
            )
    return out


secagg_app = ClientApp(
    client_fn=client_fn,
    mods=[upload_meter_mod, secaggplus_mod, secagg_mark_mod, dp_clipping_mod],
)
"""ClientApp for rounds under SecAgg+ (and DP when the server clips)."""

plain_app = ClientApp(client_fn=client_fn, mods=[upload_meter_mod, plain_mark_mod, dp_clipping_mod])
"""ClientApp for rounds without SecAgg+."""
