"""A plan: which device runs which half-open range of units, and what it is predicted to cost."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, NonNegativeFloat, NonNegativeInt

from protocols.base import FrozenModel


class Objective(StrEnum):
    """What the planner optimises."""

    THROUGHPUT = "throughput"
    """Minimise the bottleneck: the largest of every stage's max(compute, send), and of the
    requester's in- and out-transfers when a requester is modelled."""
    LATENCY = "latency"
    """Minimise end-to-end time: total compute plus total transfer (the requester's in- and
    out-transfers included when a requester is modelled)."""


class Stage(FrozenModel):
    """Units ``[start, end)`` on ``device``, with the plan's predictions for that stage."""

    device: str
    start: NonNegativeInt
    end: NonNegativeInt
    compute_s: NonNegativeFloat = 0.0
    transfer_s: NonNegativeFloat = 0.0
    """Time to send this stage's output to the next stage; for the last stage, to the requester
    when one is modelled (0 otherwise)."""
    memory_bytes: NonNegativeInt = 0


class Plan(FrozenModel):
    """The planner's answer; ``fedshard plan --json`` prints exactly this."""

    objective: Objective
    bottleneck_s: NonNegativeFloat
    latency_s: NonNegativeFloat
    input_transfer_s: NonNegativeFloat = 0.0
    """Time for the requester to send the input to the first stage (0 when no requester is
    modelled)."""
    stages: list[Stage] = Field(min_length=1)
