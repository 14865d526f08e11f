"""A plan: which device runs which half-open range of units, and what it is predicted to cost."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, NonNegativeFloat, NonNegativeInt

from protocols.base import FrozenModel


class Objective(StrEnum):
    """What the planner optimises."""

    THROUGHPUT = "throughput"
    """Minimise the bottleneck: the largest of every stage's max(compute, send)."""
    LATENCY = "latency"
    """Minimise end-to-end time: total compute plus total transfer."""


class Stage(FrozenModel):
    """Units ``[start, end)`` on ``device``, with the plan's predictions for that stage."""

    device: str
    start: NonNegativeInt
    end: NonNegativeInt
    compute_s: NonNegativeFloat = 0.0
    transfer_s: NonNegativeFloat = 0.0
    """Time to send this stage's output to the next stage (0 for the last)."""
    memory_bytes: NonNegativeInt = 0


class Plan(FrozenModel):
    """The planner's answer; ``fedshard plan --json`` prints exactly this."""

    objective: Objective
    bottleneck_s: NonNegativeFloat
    latency_s: NonNegativeFloat
    stages: list[Stage] = Field(min_length=1)
