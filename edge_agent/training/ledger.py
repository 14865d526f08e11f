"""This device's privacy ledger and the budget its operator set (format: :mod:`protocols.privacy`).

Before a round trains, :func:`check_round` composes the ledger with the round's planned
mechanism (its noise multiplier, the sample rate ``1 / ceil(records / batch)`` and the steps
``epochs · ceil(records / batch)`` Opacus will take, an upper bound) and declines the round
(:class:`~edge_agent.training.errors.RoundDeclinedError`, with a
:class:`~protocols.ledger.DeclineReason`) when it would take the epsilon past the budget, or
when it trains without DP or without SecAgg+ and the operator did not allow that. After the
round trained, and before its reply leaves, the round's actual mechanism is appended
(:meth:`PrivacyLedger.append`).

Composition: dp-accounting's RDP accountant over every DP round of the ledger (whatever run,
digest or later fate), converted at the smallest recorded δ; δ summed over the runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import pydantic
from pydantic import Field, TypeAdapter

from edge_agent.training.errors import LedgerError, RoundDeclinedError
from protocols.ledger import (
    DeclineReason,
    LedgerDp,
    LedgerLine,
    LedgerRound,
    LedgerStatus,
    PrivacyStatus,
    RunFate,
)

RDP_ORDERS = [1.75 + x / 4 for x in range(41)] + list(range(12, 257))
"""RDP orders the accountant tries (Opacus' range, without the orders below 1.75, on which
dp-accounting's series does not converge for noise multipliers near 1)."""
_LINE = TypeAdapter(Annotated[LedgerLine, Field(discriminator="kind")])


@dataclass(frozen=True)
class PrivacyPolicy:
    """What this device's operator allows (``fedshard agent --privacy-budget ...``)."""

    ledger_file: Path
    budget: float | None = None
    """Largest epsilon the ledger may reach (None: no limit, the ledger still counts)."""
    allow_non_dp: bool = False
    allow_non_secagg: bool = False


def compose(mechanisms: Sequence[LedgerDp]) -> tuple[float, float]:
    """(epsilon, delta) of every mechanism together: RDP composition at the smallest δ; the
    δ of each distinct mechanism summed (capped below 1). (0, 0) for none."""
    from dp_accounting import dp_event  # heavy: scipy, kept off the agent's import
    from dp_accounting.rdp import rdp_privacy_accountant

    if not mechanisms:
        return 0.0, 0.0
    accountant = rdp_privacy_accountant.RdpAccountant(RDP_ORDERS)
    for m in mechanisms:
        sampled = dp_event.PoissonSampledDpEvent(
            m.sample_rate, dp_event.GaussianDpEvent(m.noise_multiplier)
        )
        accountant.compose(dp_event.SelfComposedDpEvent(sampled, m.steps))
    delta = min(m.delta for m in mechanisms)
    return float(accountant.get_epsilon(delta)), min(sum(m.delta for m in mechanisms), 0.999)


def planned_mechanism(
    noise_multiplier: float, delta: float, records: int, batch_size: int, epochs: int
) -> LedgerDp:
    """The mechanism Opacus runs for a round on ``records`` records (Poisson sampling at
    ``1 / len(loader)``, one step per batch of every epoch: an upper bound on the steps)."""
    batches = max(1, math.ceil(records / batch_size))
    return LedgerDp(
        noise_multiplier=noise_multiplier,
        sample_rate=1.0 / batches,
        steps=epochs * batches,
        delta=delta,
    )


def ceil_significant(x: float, digits: int = 2) -> float:
    """``x`` rounded up to ``digits`` significant digits (what a device reports of epsilon)."""
    if x <= 0 or not math.isfinite(x):
        return x
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(x)))
    return math.ceil(x * scale - 1e-9) / scale


class PrivacyLedger:
    """The append-only ledger file (JSON lines); unreadable lines are a :class:`LedgerError`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def lines(self) -> list[LedgerLine]:
        """Every line, oldest first (none when the file does not exist yet)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise LedgerError(f"{self.path}: unreadable privacy ledger: {exc}") from exc
        out: list[LedgerLine] = []
        for number, line in enumerate(text.splitlines(), 1):
            try:
                out.append(_LINE.validate_json(line))
            except pydantic.ValidationError as exc:
                raise LedgerError(f"{self.path}:{number}: not a ledger line: {exc}") from exc
        return out

    def append(self, line: LedgerLine) -> None:
        """Append one line and fsync it (one ``write`` of a whole line, ``O_APPEND``)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = (json.dumps(line.model_dump(mode="json"), separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def rounds(self) -> list[LedgerRound]:
        """The round lines."""
        return [line for line in self.lines() if isinstance(line, LedgerRound)]

    def mark(self, run: str, fate: RunFate) -> None:
        """Record what became of ``run`` (its rounds keep counting)."""
        self.append(LedgerStatus(run=run, fate=fate, at=time.time()))

    def status(self, policy: PrivacyPolicy) -> PrivacyStatus:
        """The ledger's totals under ``policy``."""
        lines = self.lines()
        rounds = [line for line in lines if isinstance(line, LedgerRound)]
        spent, delta = compose([r.dp for r in rounds if r.dp is not None])
        fates = {line.run: line.fate for line in lines if isinstance(line, LedgerStatus)}
        bad = {r.run for r in rounds if fates.get(r.run, RunFate.ROLLED_OUT) != RunFate.ROLLED_OUT}
        remaining = None if policy.budget is None else max(policy.budget - spent, 0.0)
        return PrivacyStatus(
            epsilon_spent=spent,
            delta_spent=delta,
            budget=policy.budget,
            remaining=remaining,
            rounds=len(rounds),
            non_dp_rounds=sum(r.dp is None for r in rounds),
            non_secagg_rounds=sum(not r.secagg for r in rounds),
            failed_runs=len(bad),
            allow_non_dp=policy.allow_non_dp,
            allow_non_secagg=policy.allow_non_secagg,
        )


def check_round(policy: PrivacyPolicy, planned: LedgerDp | None, secagg: bool) -> None:
    """Raise :class:`RoundDeclinedError` unless ``policy`` allows a round with this mechanism
    (None: no DP) and this transport; reads the ledger (a :class:`LedgerError` declines too)."""
    if planned is None and not policy.allow_non_dp:
        raise RoundDeclinedError(
            DeclineReason.DP_REQUIRED, "this device trains only with record-level DP"
        )
    if not secagg and not policy.allow_non_secagg:
        raise RoundDeclinedError(
            DeclineReason.SECAGG_REQUIRED, "this device sends its update only under SecAgg+"
        )
    if planned is None or policy.budget is None:
        return
    before = [r.dp for r in PrivacyLedger(policy.ledger_file).rounds() if r.dp is not None]
    after, _ = compose([*before, planned])
    if after > policy.budget:
        spent, _ = compose(before)
        raise RoundDeclinedError(
            DeclineReason.BUDGET_EXCEEDED,
            f"epsilon {spent:.3g} spent, {after:.3g} after this round, budget {policy.budget:g}",
        )


def record_round(
    policy: PrivacyPolicy,
    data_sha256: str,
    run: str,
    round_number: int,
    mechanism: LedgerDp | None,
    secagg: bool,
    version_sha256: str | None = None,
) -> LedgerRound:
    """Append the round that just trained (call before its reply leaves the device); first mark
    as branched every earlier run that trained the same version (see :func:`branched_runs`)."""
    ledger = PrivacyLedger(policy.ledger_file)
    if version_sha256 is not None:
        for earlier in branched_runs(ledger.lines(), run, version_sha256):
            ledger.mark(earlier, RunFate.BRANCHED)
    epsilon = None if mechanism is None else compose([mechanism])[0]
    line = LedgerRound(
        data_sha256=data_sha256, run=run, round=round_number, at=time.time(), dp=mechanism,
        secagg=secagg, epsilon=epsilon, version_sha256=version_sha256,
    )  # fmt: skip
    ledger.append(line)
    return line


def branched_runs(lines: Sequence[LedgerLine], run: str, version_sha256: str) -> list[str]:
    """Earlier runs that trained ``version_sha256`` too, not yet marked branched: a run starting
    again from their starting version shows their result was rolled back or left aside."""
    marked = {
        line.run
        for line in lines
        if isinstance(line, LedgerStatus) and line.fate == RunFate.BRANCHED
    }
    same = [
        line.run
        for line in lines
        if isinstance(line, LedgerRound)
        and line.version_sha256 == version_sha256
        and line.run != run
        and line.run not in marked
    ]
    return list(dict.fromkeys(same))


def version_digest(segment_sha256s: Sequence[str]) -> str:
    """The digest of a version a ledger line names: SHA-256 over its segments' hashes."""
    return hashlib.sha256("\n".join(segment_sha256s).encode()).hexdigest()
