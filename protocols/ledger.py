"""``fedshard.privacyledger/1``: what a training device's records have spent.

Each training agent keeps an append-only JSON-lines file in its state dir
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
:class:`PrivacyStatus` is what a device reports of it (``GET`` :data:`PRIVACY_PATH`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat

from protocols.base import FrozenModel

LEDGER_FORMAT: Final = "fedshard.privacyledger/1"
LEDGER_FILE: Final = "privacy-ledger.jsonl"
"""The ledger's file name in the agent's training work dir (``STATE_DIR/training``)."""
PRIVACY_PATH: Final = "/v1/training/privacy"
"""A training agent's control-plane route (coordinator only): ``GET`` -> :class:`PrivacyStatus`."""


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
    version_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """Digest of the version the run trained (its segments' hashes, in order): a later run that
    starts from the same version shows this run's result is not in its lineage (branched)."""


class LedgerStatus(FrozenModel):
    """A later fact about a run the device trained in (appended, never rewritten)."""

    format: Literal["fedshard.privacyledger/1"] = LEDGER_FORMAT
    kind: Literal["status"] = "status"
    run: str = Field(min_length=1, max_length=64)
    fate: RunFate
    at: float


LedgerLine = LedgerRound | LedgerStatus


class RunFateReport(FrozenModel):
    """``POST`` :data:`PRIVACY_PATH` (coordinator only): what became of a run; the device appends
    a :class:`LedgerStatus` (informational: a run's rounds count whatever its fate)."""

    run: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    fate: RunFate


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
