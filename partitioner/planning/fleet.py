"""Interchangeable devices, grouped into classes, and the count-vector state space over them.

Two devices are *interchangeable* when swapping them changes nothing the planner can see: same
type, same memory, the same effective link (bandwidth and latency) to every other device and,
when the problem has a requester, the same link to the requester.
Swapping is then an automorphism of the problem, and these transpositions generate a group, so
"interchangeable" is an equivalence relation and its classes can be found with union-find. Within
a class every pair of members has the same link too, so the links between classes, and inside one,
are well defined.

The dynamic programme then tracks *how many* devices of each class are in use (a count vector)
instead of which ones, which turns ``2^D`` subsets into ``prod(size_k + 1)`` states.

A stage's transfer depends on the link from its device to the next one, so a state also records
the class of its last stage, but only up to *sender groups*: classes whose outgoing links are the
same toward every class they could hand over to and, with a requester, toward the requester (a
complete chain's out-transfer depends on its last stage's device). On a LAN where every pair has
the same link (the common case) there is a single group and the last stage's class need not be
tracked at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np
import numpy.typing as npt

from partitioner.errors import PlanningInputError
from partitioner.planning.semantics import link_between, requester_link
from protocols.problem import PlanningProblem

LinkValue = tuple[float, float]
"""``(bandwidth_mbps, latency_ms)``."""

MAX_STATES = 1 << 17
"""Largest count-vector state space the planner accepts (17 devices that are all distinct)."""


@dataclass(frozen=True)
class DeviceClass:
    """Devices that are interchangeable for planning."""

    devices: tuple[int, ...]
    """Indices into ``problem.devices``, in problem order."""
    type: str
    memory_bytes: int


@dataclass(frozen=True)
class Fleet:
    """The devices of a problem, grouped for the dynamic programme."""

    classes: tuple[DeviceClass, ...]
    links: dict[tuple[int, int], LinkValue]
    """Link between a device of class ``x`` and one of class ``y`` (``x == y``: two members)."""
    groups: tuple[tuple[int, ...], ...]
    """Sender groups: classes that hand over to any class through identical links."""
    group_of: tuple[int, ...]
    """The sender group of each class."""
    requester: tuple[LinkValue, ...] | None
    """Per class, the link between the requester and its devices; ``None`` without a requester."""
    sizes: npt.NDArray[np.int64]
    strides: npt.NDArray[np.int64]
    counts: npt.NDArray[np.int64]
    """``(n_states, K)``: devices of each class in use, per state (mixed-radix encoding)."""

    @property
    def n_states(self) -> int:
        """Number of count vectors."""
        return int(self.counts.shape[0])

    def group_link(self, group: int, target: int) -> LinkValue | None:
        """Link from any class of ``group`` to class ``target``; ``None`` if no hand-over exists."""
        for sender in self.groups[group]:
            link = self.links.get((sender, target))
            if link is not None:
                return link
        return None


def build_fleet(problem: PlanningProblem) -> Fleet:
    """Group the devices of ``problem`` into classes, sender groups and count-vector states."""
    matrix = _link_matrix(problem)
    to_requester = _requester_links(problem)
    classes = _classes(problem, matrix, to_requester)
    sizes = np.array([len(cls.devices) for cls in classes], dtype=np.int64)
    n_states = int(np.prod(sizes + 1))
    if n_states > MAX_STATES:
        raise PlanningInputError(
            f"{len(classes)} kinds of device give {n_states} planning states, over the "
            f"{MAX_STATES} that exact planning handles; make more devices alike (same type, "
            "memory and links) or plan fewer at a time"
        )
    links = _class_links(classes, matrix)
    requester = (
        None if to_requester is None else tuple(to_requester[cls.devices[0]] for cls in classes)
    )
    groups, group_of = _sender_groups(classes, links, requester)
    strides = np.concatenate([[1], np.cumprod(sizes + 1)[:-1]]).astype(np.int64)
    states = np.arange(n_states, dtype=np.int64)
    counts = (states[:, None] // strides[None, :]) % (sizes[None, :] + 1)
    return Fleet(
        classes=classes,
        links=links,
        requester=requester,
        groups=groups,
        group_of=group_of,
        sizes=sizes,
        strides=strides,
        counts=counts,
    )


def _link_matrix(problem: PlanningProblem) -> list[list[LinkValue]]:
    devices = problem.devices
    return [
        [link_between(problem, a, b) if a is not b else (0.0, 0.0) for b in devices]
        for a in devices
    ]


def _requester_links(problem: PlanningProblem) -> list[LinkValue] | None:
    """Per device, its link to the requester; ``None`` without a requester."""
    requester = problem.requester
    if requester is None:
        return None
    return [requester_link(requester, device) for device in problem.devices]


def _swappable(
    problem: PlanningProblem,
    matrix: list[list[LinkValue]],
    to_requester: list[LinkValue] | None,
    i: int,
    j: int,
) -> bool:
    a, b = problem.devices[i], problem.devices[j]
    if (a.type, a.memory_bytes) != (b.type, b.memory_bytes):
        return False
    if to_requester is not None and to_requester[i] != to_requester[j]:
        return False
    others = (k for k in range(len(problem.devices)) if k not in (i, j))
    return all(matrix[i][k] == matrix[j][k] for k in others)


def _classes(
    problem: PlanningProblem, matrix: list[list[LinkValue]], to_requester: list[LinkValue] | None
) -> tuple[DeviceClass, ...]:
    parent = list(range(len(problem.devices)))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, j in combinations(range(len(problem.devices)), 2):
        if root(i) != root(j) and _swappable(problem, matrix, to_requester, i, j):
            parent[max(root(i), root(j))] = min(root(i), root(j))
    members: dict[int, list[int]] = {}
    for index in range(len(problem.devices)):
        members.setdefault(root(index), []).append(index)
    return tuple(
        DeviceClass(
            devices=tuple(group),
            type=problem.devices[group[0]].type,
            memory_bytes=problem.devices[group[0]].memory_bytes,
        )
        for group in sorted(members.values())
    )


def _class_links(
    classes: tuple[DeviceClass, ...], matrix: list[list[LinkValue]]
) -> dict[tuple[int, int], LinkValue]:
    links: dict[tuple[int, int], LinkValue] = {}
    for x, source in enumerate(classes):
        for y, target in enumerate(classes):
            if x != y:
                links[(x, y)] = matrix[source.devices[0]][target.devices[0]]
            elif len(source.devices) > 1:
                links[(x, y)] = matrix[source.devices[0]][source.devices[1]]
    return links


def _sender_groups(
    classes: tuple[DeviceClass, ...],
    links: dict[tuple[int, int], LinkValue],
    requester: tuple[LinkValue, ...] | None,
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Greedily merge classes into groups whose hand-overs all use identical links.

    A hand-over from class ``x`` to class ``y`` exists unless ``x == y`` and the class has one
    member; a group is valid when, for every target class, all its hand-overs agree, and all
    its classes have the same link to the requester (if there is one).
    """
    groups: list[list[int]] = []
    for cls in range(len(classes)):
        for group in groups:
            same_requester = requester is None or requester[group[0]] == requester[cls]
            if same_requester and _consistent([*group, cls], len(classes), links):
                group.append(cls)
                break
        else:
            groups.append([cls])
    group_of = [0] * len(classes)
    for index, group in enumerate(groups):
        for cls in group:
            group_of[cls] = index
    return tuple(tuple(group) for group in groups), tuple(group_of)


def _consistent(group: list[int], n_classes: int, links: dict[tuple[int, int], LinkValue]) -> bool:
    for target in range(n_classes):
        seen = {links[(sender, target)] for sender in group if (sender, target) in links}
        if len(seen) > 1:
            return False
    return True
