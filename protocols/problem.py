"""``fedshard.problem/1`` and ``/2``: a planning problem stated directly.

A model is a chain of *units*; devices each hold at most one contiguous stage of
units. The semantics (which the planner implements exactly) are:

- a stage's compute is the sum of its units' seconds on the device's type, each added left
  to right: ``compute_s[device.type]`` when given, otherwise (``/2`` only) the unit's
  *roofline* time on that type, ``max(products, bytes_read / (gbps * 1e9)) + vector + gemv
  + ops * op_us / 1e6 + topk_elements * topk_ns / 1e9`` with ``products`` its FLOPs over the
  devices' ``gflops``, ``vector`` its element-wise FLOPs over ``vector_gflops`` and ``gemv``
  its one-row 4-bit products over ``gemv_gflops`` (FLOPs of a roof the type lacks count in
  ``products``), memory roof ``gbps`` (GB/s, 10^9 bytes/s: ``cache_gbps`` when the
  *stage's* units read at most ``cache_bytes`` together, else ``memory_gbps``; without
  either, the compute terms alone), operator cost ``op_us`` and selection cost ``topk_ns``,
  see :func:`roofline_s`; then
  (``/2``, a type with roofs) the device's ``call_us / 1e6`` is added once: running a
  segment at all costs that much;
- every stage but the last sends its last unit's ``out_bytes`` to the next stage's
  device, taking ``out_bytes * 8 / (bandwidth_mbps * 1e6) + latency_ms / 1e3`` seconds,
  where the link is the ``links`` entry for the pair if any, otherwise the smaller of
  the two devices' ``bandwidth_mbps`` with zero latency;
- with a ``requester`` (the coordinator, where requests come from), the first stage first
  receives ``input_bytes`` from it (the *in-transfer*) and the last stage sends its last
  unit's ``out_bytes`` back to it (the *out-transfer*), each taking the same formula's time
  over the requester's ``links`` entry for that device if any, otherwise the device's own
  ``bandwidth_mbps`` with zero latency; without one (``None``) both are absent;
- latency is ``in-transfer + compute_1 + transfer_1 + ... + compute_K + out-transfer``,
  added in that order (without a requester: from ``compute_1`` to ``compute_K``);
- the bottleneck is the largest of the in-transfer, every stage's compute and transfer,
  and the out-transfer;
- a stage's memory is the sum of its units' ``weight_bytes``, plus each shared weight
  used by any of its units (counted once per stage), plus the largest
  ``workspace_bytes`` of its units, plus
  ``(in_bytes + out_bytes) * (1 + queue_depth)`` where ``in_bytes`` is ``input_bytes``
  for the first stage and the previous unit's ``out_bytes`` otherwise; it must be at
  most the device's ``memory_bytes``.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, model_validator

from protocols.base import FrozenModel
from protocols.constants import DEFAULT_QUEUE_DEPTH, PROBLEM_FORMAT, ROOFLINE_PROBLEM_FORMAT
from protocols.links import Link, Requester, check_links, check_requester
from protocols.roofs import ROOF_FIELD_NAMES, RoofFields, roof_values


class Work(FrozenModel):
    """What one unit does in one phase: multiply-adds and bytes it must read from memory."""

    flops: NonNegativeInt
    bytes_read: NonNegativeInt
    """Its weights at their stored precision (scales and zero points included), the
    activations it reads and writes and, for a decoder, its KV cache at the costed context."""
    ops: NonNegativeInt = 0
    """Operators (kernel launches) it runs: each costs the device's ``op_us`` on top."""
    topk_elements: NonNegativeInt = 0
    """Elements its ``TopK`` operators select from: each costs the device's ``topk_ns``."""
    gemv_flops: NonNegativeInt = 0
    """The part of ``flops`` done by 4-bit weight products over at most a few rows (a decode
    step's ``MatMulNBits``): priced at the device's ``gemv_gflops``."""
    vector_flops: NonNegativeInt = 0
    """The part of ``flops`` done by element-wise operators (everything but products, gathers,
    views and ``TopK``: arithmetic, activations, normalisations, softmax, transposes), one per
    element: priced at the device's ``vector_gflops``."""


class Unit(FrozenModel):
    """One step of the chain: the smallest piece the planner places."""

    name: str
    weight_bytes: NonNegativeInt
    out_bytes: NonNegativeInt
    compute_s: dict[str, NonNegativeFloat] = Field(default_factory=dict)
    """Seconds per micro-batch, keyed by device type; a type missing here is priced by the
    roofline of ``work`` (``/2`` only)."""
    workspace_bytes: NonNegativeInt = 0
    """Peak activation workspace while the unit runs; a stage adds the largest of its units'."""
    work: Work | None = None
    """``/2``: the planned phase's work (an encoder request, a decoder's decode step)."""
    prefill: Work | None = None
    """``/2``, decoders: the work of prefilling the prompt; shown next to the plan, never
    planned on."""


class SharedWeight(FrozenModel):
    """A weight used by several units (a tied embedding): counted once in each stage using it."""

    name: str
    bytes: NonNegativeInt
    units: list[NonNegativeInt] = Field(min_length=1)


class _ProblemDeviceHead(FrozenModel):
    """The fields of a :class:`ProblemDevice` before its roofs."""

    name: str = Field(min_length=1)
    type: str = Field(min_length=1)
    memory_bytes: NonNegativeInt
    bandwidth_mbps: PositiveFloat
    gflops: PositiveFloat | None = None
    """``/2``: compute roof, GFLOP/s (devices of one type must agree)."""


class ProblemDevice(RoofFields, _ProblemDeviceHead):
    """A device the planner may use."""

    # Its roofs (RoofFields) are ``/2`` only, and devices of one type must agree on them.

    def roofs(self) -> Roofs | None:
        """The device's roofs (None without a compute roof)."""
        if self.gflops is None:
            return None
        return Roofs(gflops=self.gflops, **roof_values(self))


_ROOF_FIELDS = ("gflops", *ROOF_FIELD_NAMES)


class Roofs(RoofFields):
    """A device type's roofs: compute, memory (and the cache below it), operator cost."""

    gflops: PositiveFloat

    def compute_s(self, work: Work) -> float:
        """Seconds of all of ``work``'s FLOPs: :meth:`product_s`, :meth:`vector_s` and
        :meth:`gemv_s`."""
        return self.product_s(work) + self.vector_s(work) + self.gemv_s(work)

    def product_s(self, work: Work) -> float:
        """Seconds of the FLOPs at ``gflops``: all but the element-wise ones and the one-row
        4-bit products where their roofs are measured."""
        rest = work.flops - self._gemv_flops(work) - self._vector_flops(work)
        return float(rest) / (self.gflops * 1e9)

    def vector_s(self, work: Work) -> float:
        """Seconds of ``work``'s element-wise FLOPs at ``vector_gflops`` (0 unmeasured)."""
        if self.vector_gflops is None:
            return 0.0
        return float(self._vector_flops(work)) / (self.vector_gflops * 1e9)

    def gemv_s(self, work: Work) -> float:
        """Seconds of ``work``'s one-row 4-bit products at ``gemv_gflops`` (0 unmeasured)."""
        if self.gemv_gflops is None:
            return 0.0
        return float(self._gemv_flops(work)) / (self.gemv_gflops * 1e9)

    def _gemv_flops(self, work: Work) -> int:
        return min(work.gemv_flops, work.flops) if self.gemv_gflops is not None else 0

    def _vector_flops(self, work: Work) -> int:
        if self.vector_gflops is None:
            return 0
        return min(work.vector_flops, work.flops - self._gemv_flops(work))

    def memory_s(self, work: Work, stage_bytes: int | None = None) -> float:
        """Seconds reading ``work``'s bytes: at ``cache_gbps`` when the stage's bytes
        (``stage_bytes``; ``work``'s own when None) fit ``cache_bytes``, else at
        ``memory_gbps`` (0 without a memory roof)."""
        gbps = self.bandwidth_gbps(work.bytes_read if stage_bytes is None else stage_bytes)
        return 0.0 if gbps is None else float(work.bytes_read) / (gbps * 1e9)

    def bandwidth_gbps(self, bytes_read: int) -> float | None:
        """The bandwidth ``bytes_read`` bytes are read at: the cache's if they fit in it."""
        if self.cache_gbps is not None and bytes_read <= self.cache_bytes:
            return self.cache_gbps
        return self.memory_gbps


def roofline_s(work: Work, roofs: Roofs, stage_bytes: int | None = None) -> float:
    """Seconds of ``work`` (a unit) under ``roofs`` in a stage whose units read ``stage_bytes``
    together (None: the unit on its own): ``max(products, memory) + vector + gemv + ops * op_us
    / 1e6 + topk_elements * topk_ns / 1e9``.

    ``products`` is :meth:`Roofs.product_s` (FLOPs at ``gflops``), ``vector``
    :meth:`Roofs.vector_s` (element-wise FLOPs at ``vector_gflops``), ``gemv``
    :meth:`Roofs.gemv_s` (one-row 4-bit products at ``gemv_gflops``) and ``memory``
    :meth:`Roofs.memory_s`: ``bytes_read / (gbps 1e9)`` with ``cache_gbps`` when the *stage's*
    bytes fit ``cache_bytes`` (an agent runs its stage over and over: its units' weights stay
    cached only if all of them fit), else ``memory_gbps``. Only a product kernel overlaps its
    reads with its arithmetic: element-wise kernels run before and after it on one core, and
    the 4-bit products' unpacking does not overlap their reads either (Qwen2.5-Coder-1.5B int4
    decode stages measured their gemv time plus their bytes over the memory roof, 0.99-1.11x,
    not the larger of the two, 0.42-0.46x)."""
    busy = max(roofs.product_s(work), roofs.memory_s(work, stage_bytes))
    busy += roofs.vector_s(work) + roofs.gemv_s(work)
    fixed = float(work.ops) * roofs.op_us / 1e6
    return busy + fixed + float(work.topk_elements) * roofs.topk_ns / 1e9


class PlanningProblem(FrozenModel):
    """A ``fedshard.problem/1`` or ``/2`` document (``/2`` adds roofline costs)."""

    format: Literal["fedshard.problem/1", "fedshard.problem/2"] = PROBLEM_FORMAT
    name: str = ""
    input_bytes: NonNegativeInt = 0
    queue_depth: NonNegativeInt = DEFAULT_QUEUE_DEPTH
    units: list[Unit] = Field(min_length=1)
    devices: list[ProblemDevice] = Field(min_length=1)
    links: list[Link] = Field(default_factory=list)
    shared_weights: list[SharedWeight] = Field(default_factory=list)
    requester: Requester | None = None
    """Where inputs come from and results go back to; ``None``: neither is counted."""
    phase: str = ""
    """``/2``: the phase ``work`` describes (``"request"``, ``"decode"``), for people."""

    def type_roofs(self) -> dict[str, Roofs]:
        """The roofs of each device type whose devices carry a compute roof."""
        roofs: dict[str, Roofs] = {}
        for device in self.devices:
            if (device_roofs := device.roofs()) is not None:
                roofs[device.type] = device_roofs
        return roofs

    def unit_seconds(self, index: int, device_type: str, stage_bytes: int | None = None) -> float:
        """Seconds of unit ``index`` on ``device_type`` in a stage whose units read
        ``stage_bytes`` (None: the unit alone): its ``compute_s`` entry when given, else its
        roofline time (the validator made sure one exists)."""
        unit = self.units[index]
        given = unit.compute_s.get(device_type)
        if given is not None:
            return given
        assert unit.work is not None  # checked by the validator
        return roofline_s(unit.work, self.type_roofs()[device_type], stage_bytes)

    def stage_bytes(self, start: int, end: int) -> int:
        """Bytes units ``[start, end)`` read together in the planned phase (their ``work``)."""
        return sum(u.work.bytes_read for u in self.units[start:end] if u.work is not None)

    def call_seconds(self, device_type: str) -> float:
        """Seconds one run of a stage's segment costs on ``device_type`` beyond its units:
        its ``call_us`` (0 for a type without roofs)."""
        roofs = self.type_roofs().get(device_type)
        return 0.0 if roofs is None else roofs.call_us / 1e6

    @model_validator(mode="after")
    def _check_references(self) -> Self:
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise ValueError("device names must be unique")
        roofed = self._check_roofs()
        types = {d.type for d in self.devices}
        for i, unit in enumerate(self.units):
            missing = types - unit.compute_s.keys()
            if unit.work is not None:
                missing -= roofed
            if missing:
                raise ValueError(
                    f"unit {i} ({unit.name!r}) has neither compute_s nor work and roofs for "
                    f"{sorted(missing)}"
                )
        check_links(set(names), self.links)
        check_requester(set(names), self.requester)
        for shared in self.shared_weights:
            if any(u >= len(self.units) for u in shared.units):
                raise ValueError(f"shared weight {shared.name!r} names a unit out of range")
        return self

    def _check_roofs(self) -> set[str]:
        """The device types with roofs; roofline fields need ``/2`` and agree within a type."""
        plain = tuple(ProblemDevice.model_fields[f].default for f in _ROOF_FIELDS)
        rows = [tuple(getattr(d, f) for f in _ROOF_FIELDS) for d in self.devices]
        uses = any(row != plain for row in rows) or any(
            u.work is not None or u.prefill is not None for u in self.units
        )
        if uses and self.format != ROOFLINE_PROBLEM_FORMAT:
            raise ValueError(f"roofline fields need format {ROOFLINE_PROBLEM_FORMAT!r}")
        seen: dict[str, tuple[object, ...]] = {}
        for device, row in zip(self.devices, rows, strict=True):
            if device.gflops is None and row != plain:
                raise ValueError(f"device {device.name!r} has roofs but no gflops")
            if seen.setdefault(device.type, row) != row:
                raise ValueError(f"devices of type {device.type!r} have different roofs")
        return {kind for kind, row in seen.items() if row[0] is not None}
