"""The console's what-if for a version built from a GGUF file: planned from the file's header.

A what-if re-plans a deployed model on changed budgets or without some devices, deploying
nothing. An ONNX version is planned from its analysed graph; a GGUF version has no graph, so it
is planned as its deploy was (:mod:`coordinator.deploy.gguf_cut`): the header's unit table at
the version's weights and session limits (:mod:`coordinator.deploy.gguf_plan`), the planner
that prefers one device. Only tensor infos are read, so this costs the same for a 70B file as
for a tiny one.
"""

from __future__ import annotations

from pathlib import Path

from coordinator.deploy.gguf_cut import header_of
from coordinator.deploy.gguf_plan import planning_problem, unit_table
from coordinator.errors import DeployError
from partitioner.analysis.decoding import describe_state
from partitioner.errors import InfeasiblePlanError, PartitionerError
from partitioner.planning.planner import plan_preferring_one_device
from protocols.devices import DeviceList
from protocols.errors import SchemaError
from protocols.gguf_card import WeightsMode
from protocols.manifest import DEFAULT_SESSIONS, SessionLimits
from protocols.plan import Objective, Plan


def gguf_unit_names(path: Path, weights: WeightsMode = "keep") -> list[str]:
    """The planning units of the GGUF file at ``path``: ``embedding``, ``blk.N``…, ``head``
    (:class:`DeployError` if it cannot be read)."""
    return [u.name for u in unit_table(header_of(path), DEFAULT_SESSIONS, weights).units.units]


def gguf_what_if(
    path: Path,
    devices: DeviceList,
    objective: Objective,
    name: str,
    weights: WeightsMode = "keep",
    sessions: SessionLimits | None = None,
) -> tuple[Plan, list[str]]:
    """The plan a deploy of the GGUF file at ``path`` (``weights``, ``sessions``: the
    version's) would make on ``devices``, and the names of its units.

    :class:`DeployError` when the file cannot be read or no arrangement fits (with the
    shortfall and the KV cache in plain words)."""
    limits = sessions or DEFAULT_SESSIONS
    table = unit_table(header_of(path), limits, weights)
    names = [u.name for u in table.units.units]
    try:
        problem = planning_problem(table, devices, name)
        return plan_preferring_one_device(problem, objective), names
    except InfeasiblePlanError as exc:
        kv = describe_state(sum(table.state_bytes), limits)
        raise DeployError(f"no plan fits these devices: {exc}; {kv}") from exc
    except (PartitionerError, SchemaError) as exc:
        raise DeployError(f"cannot plan with these devices: {exc}") from exc
