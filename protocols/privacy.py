"""``fedshard.privacyledger/1``: what a training device's records have spent, and what leaves it.

**The ledger.** Each training agent keeps an append-only JSON-lines file in its state dir
(``STATE_DIR/training/privacy-ledger.jsonl``). A :class:`LedgerRound` line is written for every
round the device trains in, *before* its reply leaves the device (a round whose reply never left
is counted too: the ledger errs on the side of spending). A :class:`LedgerStatus` line marks a
run's later fate (failed, diverged, rolled back, branched) without rewriting anything. Lines are
keyed by :attr:`LedgerRound.data_sha256`, a digest of the records trained on, not by run or
round: the guarantee is about records, whichever run used them. The totals compose *every* DP
round of the ledger, whatever its digest or status (records carry over when a device's data
grows, and a failed or rolled-back run's replies left the device all the same): RDP composition
of the recorded (noise multiplier, sample rate, steps), converted at the smallest recorded δ;
the δ reported beside it is the sum of the runs' δ (so both figures are upper bounds).

**Fields that leave a device in a round** (:data:`FIT_REPLY_FIELDS`; a test checks a real reply
against it). Under DP only the masked adapters and values that follow from the plan (public) or
from the privacy accounting leave the device; nothing computed from its records in clear.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat

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

LEDGER_FORMAT: Final = "fedshard.privacyledger/1"
LEDGER_FILE: Final = "privacy-ledger.jsonl"
"""The ledger's file name in the agent's training work dir (``STATE_DIR/training``)."""
PRIVACY_PATH: Final = "/v1/training/privacy"
"""A training agent's control-plane route (coordinator only): ``GET`` -> :class:`PrivacyStatus`."""
SECAGG_CONFIG_KEY: Final = "fedshard-secagg"
"""Fit-config key the device's own ClientApp mods set (overwriting whatever the server sent):
True only when the round's reply goes through Flower's ``secaggplus_mod`` (masked)."""


class DeclineReason(StrEnum):
    """Why a device declined a round (the first word of its error)."""

    BUDGET_EXCEEDED = "budget-exceeded"
    """The round would take the ledger's epsilon past the operator's ``--privacy-budget``."""
    DP_REQUIRED = "dp-required"
    """The round trains without record-level DP on the device (``--allow-non-dp`` not given)."""
    SECAGG_REQUIRED = "secagg-required"
    """The reply would leave unmasked, without SecAgg+ (``--allow-non-secagg`` not given)."""


class RunFate(StrEnum):
    """What became of a run after the device's rounds (:class:`LedgerStatus`)."""

    FAILED = "failed"
    DIVERGED = "diverged"
    ROLLED_BACK = "rolled-back"
    BRANCHED = "branched"
    ROLLED_OUT = "rolled-out"


class LedgerDp(FrozenModel):
    """The DP-SGD mechanism of one round, as the accountant composes it."""

    noise_multiplier: PositiveFloat
    sample_rate: float = Field(gt=0, le=1)
    steps: NonNegativeInt
    delta: PositiveFloat = Field(lt=1)


class LedgerRound(FrozenModel):
    """One round this device trained in (its reply may have left it)."""

    format: Literal["fedshard.privacyledger/1"] = LEDGER_FORMAT
    kind: Literal["round"] = "round"
    data_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """SHA-256 over the records trained on (the ledger's key)."""
    run: str = Field(min_length=1, max_length=64)
    round: NonNegativeInt
    at: float
    """Unix time the line was written."""
    dp: LedgerDp | None
    """None: the round trained without DP (allowed by ``--allow-non-dp``): no finite epsilon."""
    secagg: bool
    """Whether the reply was masked by SecAgg+."""
    epsilon: NonNegativeFloat | None
    """This round alone, at its own δ (None without DP)."""


class LedgerStatus(FrozenModel):
    """A later fact about a run the device trained in (appended, never rewritten)."""

    format: Literal["fedshard.privacyledger/1"] = LEDGER_FORMAT
    kind: Literal["status"] = "status"
    run: str = Field(min_length=1, max_length=64)
    fate: RunFate
    at: float


LedgerLine = LedgerRound | LedgerStatus


class PrivacyStatus(FrozenModel):
    """A device's ledger totals, as it reports them with its training status (not private:
    figures of the accounting, not of the records)."""

    epsilon_spent: NonNegativeFloat
    """RDP composition of every DP round in the ledger (0 before any)."""
    delta_spent: NonNegativeFloat
    """Sum of the δ of the runs composed."""
    budget: PositiveFloat | None = None
    """The operator's ``--privacy-budget`` (None: none set)."""
    remaining: NonNegativeFloat | None = None
    """``budget - epsilon_spent`` (floored at 0); None without a budget."""
    rounds: NonNegativeInt = 0
    non_dp_rounds: NonNegativeInt = 0
    """Rounds trained without DP: while any, no finite epsilon holds for the device's data."""
    non_secagg_rounds: NonNegativeInt = 0
    failed_runs: NonNegativeInt = 0
    """Runs marked failed, diverged, rolled back or branched (their rounds still count)."""
    allow_non_dp: bool = False
    allow_non_secagg: bool = False


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
        what="the adapters after local training (masked by SecAgg+ when the run uses it)",
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
        what="held-out loss of the round's global model",
    ),
    ReplyField(
        name=METRIC_HELD_OUT_TOKENS, under_dp="absent", without_dp="clear",
        what="held-out tokens (pairs) behind that loss",
    ),
    ReplyField(
        name=METRIC_RECALL_AT_1, under_dp="absent", without_dp="clear",
        what="an encoder's held-out recall@1",
    ),
    ReplyField(
        name=METRIC_PEAK_RSS, under_dp="absent", without_dp="clear",
        what="the training process's peak memory (depends on the data)",
    ),
)  # fmt: skip
"""Every field of a fit reply (the arrays, the weight, each metric key)."""


def reply_fields(dp: bool, *, sent: bool = True) -> frozenset[str]:
    """Names of the fit-reply fields a device sends (``sent``) or keeps (not ``sent``)."""
    return frozenset(
        f.name
        for f in FIT_REPLY_FIELDS
        if ((f.under_dp if dp else f.without_dp) != "absent") == sent
    )
