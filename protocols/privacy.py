"""What leaves a training device in a round, and how (issue 39: the privacy promise holds
against the coordinator too).

:data:`FIT_REPLY_FIELDS` lists every field of a fit reply and :data:`EVALUATE_REPLY_FIELDS`
every field of an evaluate reply (a test checks real replies against them). Under DP only the
masked adapters (with the held-out statistics inside the masked vector) and values that follow
from the plan (public) or from the privacy accounting leave the device; nothing computed from
its records in clear, and no clear evaluation at all. The ledger a device keeps of what its
records spent is :mod:`protocols.ledger`.
"""

from __future__ import annotations

from typing import Final, Literal

from protocols.base import FrozenModel
from protocols.lora import (
    METRIC_EPSILON,
    METRIC_HELD_OUT_LOSS,
    METRIC_HELD_OUT_TOKENS,
    METRIC_PEAK_RSS,
    METRIC_RECALL_AT_1,
    METRIC_TRAINED_BYTES,
)
from protocols.training import (
    METRIC_ACCURACY,
    METRIC_EXAMPLES,
    METRIC_LOSS,
    METRIC_TRAINED_SHARDS,
    METRIC_UPLOAD_BYTES,
)

SECAGG_CONFIG_KEY: Final = "fedshard-secagg"
"""Fit-config key the device's own ClientApp mods set (overwriting whatever the server sent):
True only when the round's reply goes through Flower's ``secaggplus_mod`` (masked)."""


FieldRelease = Literal["masked", "public", "accounting", "absent", "clear"]
"""How a reply field leaves a device: ``masked`` (inside the SecAgg+ vector), ``public`` (a
function of the plan or of the model files only), ``accounting`` (the privacy accountant's
output), ``absent`` (not sent), ``clear`` (in clear; derived from the records: only without DP)."""


class ReplyField(FrozenModel):
    """One field of a device's fit reply and how it leaves under DP and without."""

    name: str
    under_dp: FieldRelease
    without_dp: FieldRelease
    what: str


FIT_REPLY_FIELDS: Final[tuple[ReplyField, ...]] = (
    ReplyField(
        name="parameters", under_dp="masked", without_dp="clear",
        what="the adapters after local training (masked by SecAgg+ when the run uses it); "
        "under DP and SecAgg+ also the held-out statistics [loss / 16, 1, recall@1, 1] "
        "(lora.stats_array), masked: the coordinator sees only the devices' means; in the "
        "evaluate-only round after the last (lora.EVALUATE_ONLY_KEY) zero adapters and the "
        "final adapters' statistics",
    ),
    ReplyField(
        name="num_examples", under_dp="public", without_dp="clear",
        what="FedAvg weight: 1 under DP (DP_REPLY_WEIGHT), else min(records, 1000)",
    ),
    ReplyField(
        name=METRIC_TRAINED_SHARDS, under_dp="public", without_dp="public",
        what="the plan's trainable segments",
    ),
    ReplyField(
        name=METRIC_TRAINED_BYTES, under_dp="public", without_dp="public",
        what="bytes of the adapted segments' base weights (from the model files)",
    ),
    ReplyField(
        name=METRIC_UPLOAD_BYTES, under_dp="public", without_dp="public",
        what="size of the update message (fixed by the plan's adapter shapes)",
    ),
    ReplyField(
        name=METRIC_EPSILON, under_dp="accounting", without_dp="absent",
        what="the run's epsilon on this device, rounded up to 2 significant digits (it depends "
        "on the sample rate batch/records, so it hints at the record count: see the docs)",
    ),
    ReplyField(
        name=METRIC_EXAMPLES, under_dp="absent", without_dp="clear", what="exact training records",
    ),
    ReplyField(
        name=METRIC_LOSS, under_dp="absent", without_dp="clear", what="mean training loss",
    ),
    ReplyField(
        name=METRIC_ACCURACY, under_dp="absent", without_dp="clear",
        what="training accuracy (shard training, which adds no noise on the device)",
    ),
    ReplyField(
        name=METRIC_HELD_OUT_LOSS, under_dp="absent", without_dp="clear",
        what="held-out loss of the round's global model (under DP with SecAgg+ inside the "
        "parameters)",
    ),
    ReplyField(
        name=METRIC_HELD_OUT_TOKENS, under_dp="absent", without_dp="clear",
        what="held-out tokens (pairs) behind that loss",
    ),
    ReplyField(
        name=METRIC_RECALL_AT_1, under_dp="absent", without_dp="clear",
        what="an encoder's held-out recall@1 (under DP with SecAgg+ inside the parameters)",
    ),
    ReplyField(
        name=METRIC_PEAK_RSS, under_dp="absent", without_dp="clear",
        what="the training process's peak memory (depends on the data)",
    ),
)  # fmt: skip
"""Every field of a fit reply (the arrays, the weight, each metric key)."""


EVALUATE_REPLY_FIELDS: Final[tuple[ReplyField, ...]] = (
    ReplyField(
        name="loss", under_dp="absent", without_dp="clear",
        what="held-out loss of the final adapters; under DP the device refuses a clear "
        "evaluation (ClearReleaseError): the final evaluation is the evaluate-only fit round, "
        "inside SecAgg+",
    ),
    ReplyField(
        name="num_examples", under_dp="absent", without_dp="clear",
        what="held-out tokens (decoders) or pairs (encoders) behind that loss",
    ),
    ReplyField(
        name=METRIC_HELD_OUT_TOKENS, under_dp="absent", without_dp="clear",
        what="the same count, as a metric",
    ),
    ReplyField(
        name=METRIC_RECALL_AT_1, under_dp="absent", without_dp="clear",
        what="an encoder's held-out recall@1 of the final adapters",
    ),
)  # fmt: skip
"""Every field of an evaluate reply (the final evaluation of a run without DP)."""


def reply_fields(
    dp: bool, *, sent: bool = True, table: tuple[ReplyField, ...] = FIT_REPLY_FIELDS
) -> frozenset[str]:
    """Names of the reply fields (of ``table``: fit replies by default) a device sends
    (``sent``) or keeps (not ``sent``)."""
    return frozenset(
        f.name for f in table if ((f.under_dp if dp else f.without_dp) != "absent") == sent
    )
